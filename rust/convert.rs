//! Element conversion between the floating-point types (F32, F16, BF16, F64).
//!
//! Works on raw little-endian bytes with no alignment assumption on either side: a block of
//! elements is decoded into an aligned scratch array, converted, and written back as bytes. Rounding
//! is round-to-nearest-even, as torch's `Tensor.to`. Conversions that involve F64 go through f64 so
//! that nothing is rounded twice; the others go through f32, which holds F16 and BF16 exactly.
//!
//! The one exception is the target BF16 ([`to_bf16`]): it reproduces torch bit for bit, which
//! rounds F64 through F32 (twice) and writes NaNs its own way.

use half::{bf16, f16};

use crate::dtype::Dtype;

const BLOCK: usize = 2048;

/// Converts `n` elements of `from` in `src` into `to` at `dst`.
///
/// `src` must hold at least `n * from.itemsize()` bytes and `dst` at least `n * to.itemsize()`;
/// both types must satisfy [`Dtype::is_convertible_float`]. Callers (the copy planner) check both.
pub fn convert(src: &[u8], from: Dtype, dst: &mut [u8], to: Dtype) {
    debug_assert!(from.is_convertible_float() && to.is_convertible_float());
    let n = src.len() / from.itemsize().unwrap_or(1);
    // The widenings every half-precision checkpoint loaded as f32 goes through: exact, and kept
    // out of the generic decode/encode loop so that they vectorize (the generic loop ran ~1 GB/s).
    match (from, to) {
        (Dtype::BF16, Dtype::F32) => return widen(&src[..2 * n], &mut dst[..4 * n], bf16_bits),
        (Dtype::F16, Dtype::F32) => return f16_to_f32(&src[..2 * n], &mut dst[..4 * n]),
        _ => {}
    }
    if to == Dtype::BF16 {
        to_bf16(src, from, dst, n);
    } else if from == Dtype::F64 || to == Dtype::F64 {
        run::<f64>(src, from, dst, to, n);
    } else {
        run::<f32>(src, from, dst, to, n);
    }
}

/// Elements per step of the fast paths: whole arrays, so the compiler sees fixed-size loops.
const LANES: usize = 16;

/// f32 bits of a bf16: its high half (exact).
#[inline(always)]
fn bf16_bits(u: u16) -> u32 {
    (u as u32) << 16
}

/// Widens 16-bit elements to 32-bit ones with `f`, `LANES` at a time (vectorized).
#[inline(always)]
fn widen(src: &[u8], dst: &mut [u8], f: impl Fn(u16) -> u32 + Copy) {
    let mut s_blocks = src.chunks_exact(2 * LANES);
    let mut d_blocks = dst.chunks_exact_mut(4 * LANES);
    for (s, d) in s_blocks.by_ref().zip(d_blocks.by_ref()) {
        let s: &[u8; 2 * LANES] = s.try_into().expect("chunks_exact");
        let d: &mut [u8; 4 * LANES] = d.try_into().expect("chunks_exact");
        for i in 0..LANES {
            let v = f(u16::from_le_bytes([s[2 * i], s[2 * i + 1]]));
            d[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
    }
    let (s_rest, d_rest) = (s_blocks.remainder(), d_blocks.into_remainder());
    for (s, d) in s_rest.chunks_exact(2).zip(d_rest.chunks_exact_mut(4)) {
        d.copy_from_slice(&f(u16::from_le_bytes([s[0], s[1]])).to_le_bytes());
    }
}

/// F16 -> F32 through `half`'s slice conversion, which uses the CPU's conversion instructions
/// (F16C, NEON) when present; blocks are staged in aligned arrays since `src` may be unaligned.
fn f16_to_f32(src: &[u8], dst: &mut [u8]) {
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    let mut bits = [0u16; BLOCK];
    let mut vals = [0f32; BLOCK];
    for (s, d) in src.chunks(2 * BLOCK).zip(dst.chunks_mut(4 * BLOCK)) {
        let k = s.len() / 2;
        for (b, c) in bits[..k].iter_mut().zip(s.chunks_exact(2)) {
            *b = u16::from_le_bytes([c[0], c[1]]);
        }
        let halves: &[f16] = bits[..k].reinterpret_cast();
        halves.convert_to_f32_slice(&mut vals[..k]);
        for (c, v) in d.chunks_exact_mut(4).zip(&vals[..k]) {
            c.copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// The intermediate type of a conversion.
trait Wide: Copy + Default {
    fn decode(bytes: &[u8], dtype: Dtype, out: &mut [Self]);
    fn encode(vals: &[Self], dtype: Dtype, out: &mut [u8]);
}

fn u16s(bytes: &[u8]) -> impl Iterator<Item = u16> + '_ {
    bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
}

fn put<const N: usize>(out: &mut [u8], vals: impl Iterator<Item = [u8; N]>) {
    for (dst, v) in out.chunks_exact_mut(N).zip(vals) {
        dst.copy_from_slice(&v);
    }
}

impl Wide for f32 {
    fn decode(bytes: &[u8], dtype: Dtype, out: &mut [f32]) {
        match dtype {
            Dtype::F32 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Dtype::F16 => {
                for (o, u) in out.iter_mut().zip(u16s(bytes)) {
                    *o = f16::from_bits(u).to_f32();
                }
            }
            Dtype::BF16 => {
                // bf16 is the high half of an f32: exact and cheap.
                for (o, u) in out.iter_mut().zip(u16s(bytes)) {
                    *o = f32::from_bits((u as u32) << 16);
                }
            }
            _ => unreachable!("f32 path is only used for F32/F16/BF16"),
        }
    }

    fn encode(vals: &[f32], dtype: Dtype, out: &mut [u8]) {
        match dtype {
            Dtype::F32 => put(out, vals.iter().map(|v| v.to_le_bytes())),
            Dtype::F16 => put(
                out,
                vals.iter()
                    .map(|&v| f16::from_f32(v).to_bits().to_le_bytes()),
            ),
            Dtype::BF16 => put(
                out,
                vals.iter()
                    .map(|&v| bf16::from_f32(v).to_bits().to_le_bytes()),
            ),
            _ => unreachable!("f32 path is only used for F32/F16/BF16"),
        }
    }
}

impl Wide for f64 {
    fn decode(bytes: &[u8], dtype: Dtype, out: &mut [f64]) {
        match dtype {
            Dtype::F64 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                    *o = f64::from_le_bytes(c.try_into().expect("chunks of 8"));
                }
            }
            _ => {
                let mut tmp = [0f32; BLOCK];
                let tmp = &mut tmp[..out.len()];
                f32::decode(bytes, dtype, tmp);
                for (o, &t) in out.iter_mut().zip(tmp.iter()) {
                    *o = t as f64;
                }
            }
        }
    }

    fn encode(vals: &[f64], dtype: Dtype, out: &mut [u8]) {
        match dtype {
            Dtype::F64 => put(out, vals.iter().map(|v| v.to_le_bytes())),
            Dtype::F32 => put(out, vals.iter().map(|&v| (v as f32).to_le_bytes())),
            Dtype::F16 => put(
                out,
                vals.iter()
                    .map(|&v| f16::from_f64(v).to_bits().to_le_bytes()),
            ),
            Dtype::BF16 => put(
                out,
                vals.iter()
                    .map(|&v| bf16::from_f64(v).to_bits().to_le_bytes()),
            ),
            _ => unreachable!("conversion is only defined between float types"),
        }
    }
}

/// BF16 bits of a non-NaN f32, rounded to nearest even (overflow rounds to infinity).
fn bf16_rne(x: f32) -> u16 {
    let bits = x.to_bits();
    ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) as u16
}

/// Conversion to BF16 exactly as torch's `Tensor.to(torch.bfloat16)` on CPU: F64 is rounded to
/// F32 first (torch has no direct F64 -> BF16 rounding; a value just past a BF16 midpoint can
/// land on it and round to even), and a NaN becomes `0xFFFF` from F32 or F64 (torch's vectorized
/// loop) and `0x7FC0` from F16, whatever its sign and payload.
fn to_bf16(src: &[u8], from: Dtype, dst: &mut [u8], n: usize) {
    let nan = if from == Dtype::F16 {
        0x7FC0u16
    } else {
        0xFFFF
    };
    let mut scratch = [0f32; BLOCK];
    let mut done = 0;
    while done < n {
        let k = BLOCK.min(n - done);
        let vals = &mut scratch[..k];
        let bytes = &src[done * from.itemsize().unwrap_or(1)..];
        if from == Dtype::F64 {
            for (o, c) in vals.iter_mut().zip(bytes.chunks_exact(8)) {
                *o = f64::from_le_bytes(c.try_into().expect("chunks of 8")) as f32;
            }
        } else {
            f32::decode(&bytes[..k * from.itemsize().unwrap_or(1)], from, vals);
        }
        put(
            &mut dst[done * 2..(done + k) * 2],
            vals.iter().map(|&v| {
                let b = if v.is_nan() { nan } else { bf16_rne(v) };
                b.to_le_bytes()
            }),
        );
        done += k;
    }
}

fn run<W: Wide>(src: &[u8], from: Dtype, dst: &mut [u8], to: Dtype, n: usize) {
    let (si, di) = (from.itemsize().unwrap_or(1), to.itemsize().unwrap_or(1));
    let mut scratch = [W::default(); BLOCK];
    let mut done = 0;
    while done < n {
        let k = BLOCK.min(n - done);
        let vals = &mut scratch[..k];
        W::decode(&src[done * si..(done + k) * si], from, vals);
        W::encode(vals, to, &mut dst[done * di..(done + k) * di]);
        done += k;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_f32(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn bf16_round_trips_through_f32_exactly() {
        let vals: Vec<f32> = (0..5000).map(|i| (i as f32 - 2500.0) * 0.37).collect();
        let src = bytes_f32(&vals);
        let mut b = vec![0u8; vals.len() * 2];
        convert(&src, Dtype::F32, &mut b, Dtype::BF16);
        let mut back = vec![0u8; vals.len() * 4];
        convert(&b, Dtype::BF16, &mut back, Dtype::F32);
        for (i, c) in back.chunks_exact(4).enumerate() {
            let got = f32::from_le_bytes(c.try_into().unwrap());
            assert_eq!(got, bf16::from_f32(vals[i]).to_f32());
        }
    }

    #[test]
    fn f16_to_bf16_rounds_like_a_two_step_conversion() {
        let vals: Vec<u16> = (0..4096u16)
            .map(|i| f16::from_f32(i as f32 * 0.01 - 20.0).to_bits())
            .collect();
        let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut out = vec![0u8; src.len()];
        convert(&src, Dtype::F16, &mut out, Dtype::BF16);
        for (i, c) in out.chunks_exact(2).enumerate() {
            let want = bf16::from_f32(f16::from_bits(vals[i]).to_f32()).to_bits();
            assert_eq!(u16::from_le_bytes([c[0], c[1]]), want);
        }
    }

    #[test]
    fn the_fast_widenings_match_the_scalar_conversions_at_every_length_and_offset() {
        // Lengths around the vector width and the block size; odd offsets make `src` unaligned.
        let bits: Vec<u16> = (0..3 * BLOCK as u32 + 37)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u16)
            .collect();
        let raw: Vec<u8> = std::iter::once(0xAB)
            .chain(bits.iter().flat_map(|v| v.to_le_bytes()))
            .collect();
        for n in [0, 1, LANES - 1, LANES, LANES + 3, BLOCK + 5, bits.len()] {
            for off in [0, 1] {
                let src = &raw[1 - off..1 - off + 2 * n];
                let halves: Vec<u16> = src
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect();
                for from in [Dtype::BF16, Dtype::F16] {
                    let mut out = vec![0u8; 4 * n];
                    convert(src, from, &mut out, Dtype::F32);
                    for (i, c) in out.chunks_exact(4).enumerate() {
                        let want = match from {
                            Dtype::BF16 => bf16::from_bits(halves[i]).to_f32(),
                            _ => f16::from_bits(halves[i]).to_f32(),
                        };
                        let got = f32::from_le_bytes(c.try_into().unwrap());
                        // NaN payloads are not what this test is about; every other value is.
                        if want.is_nan() {
                            assert!(got.is_nan(), "{from:?} n={n} i={i}");
                        } else {
                            assert_eq!(got.to_bits(), want.to_bits(), "{from:?} n={n} i={i}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn f64_to_bf16_rounds_through_f32_as_torch_does() {
        // 1 + 2^-8 is the midpoint between BF16 1.0 and 1.0078125; 2^-40 above it is lost in
        // F32, and the midpoint then rounds to even.
        let src = (1.0f64 + 2f64.powi(-8) + 2f64.powi(-40)).to_le_bytes();
        let mut out = [0u8; 2];
        convert(&src, Dtype::F64, &mut out, Dtype::BF16);
        assert_eq!(u16::from_le_bytes(out), 0x3F80);
    }

    #[test]
    fn nans_become_torchs_bf16_nans() {
        for (from, bytes, want) in [
            (Dtype::F32, 0xFF80_0001u32.to_le_bytes().to_vec(), 0xFFFF),
            (
                Dtype::F64,
                0x7FF0_0000_0000_0001u64.to_le_bytes().to_vec(),
                0xFFFF,
            ),
            (Dtype::F16, 0xFC01u16.to_le_bytes().to_vec(), 0x7FC0),
        ] {
            let mut out = [0u8; 2];
            convert(&bytes, from, &mut out, Dtype::BF16);
            assert_eq!(u16::from_le_bytes(out), want, "{from}");
        }
    }

    #[test]
    fn f64_conversions_round_once() {
        let v = [1.0f64 / 3.0, -1e300, 65504.0, 1e-8];
        let src: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut out = vec![0u8; 8];
        convert(&src, Dtype::F64, &mut out, Dtype::F16);
        let got: Vec<u16> = out
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        let want: Vec<u16> = v.iter().map(|&x| f16::from_f64(x).to_bits()).collect();
        assert_eq!(got, want);
        let mut back = vec![0u8; 32];
        convert(&out, Dtype::F16, &mut back, Dtype::F64);
        assert_eq!(
            f64::from_le_bytes(back[16..24].try_into().unwrap()),
            65504.0
        );
    }
}
