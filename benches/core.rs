//! Criterion benchmarks of the Rust core: header parsing and copy throughput.
//!
//! `cargo bench` runs them; the copy group reports bytes/s for a plain `memcpy` of the same bytes
//! next to the engine with 1 and all threads, with and without BF16 -> F32 conversion, in both read
//! modes. Every id says where the destination comes from: `fresh_dst` allocates unfaulted memory
//! each iteration (what a load does: the kernel handing out pages is part of the cost),
//! `reused_dst` writes into one buffer faulted in beforehand (the conversion loop alone).

use std::hint::black_box;
use std::io::Write;
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fastload::convert::convert;
use fastload::copy::{copy, Request, Selection};
use fastload::header::{build_header, parse_buffer};
use fastload::pool::default_threads;
use fastload::{Dtype, ReadMode, SafetensorsFile};

fn thousand_tensor_file() -> Vec<u8> {
    let spec: Vec<(String, Dtype, Vec<u64>)> = (0..1000)
        .map(|i| {
            (
                format!("model.layers.{}.mlp.proj_{}.weight", i / 10, i % 10),
                Dtype::BF16,
                vec![4, 2],
            )
        })
        .collect();
    let (mut buf, offsets) = build_header(&spec, None).unwrap();
    buf.resize(buf.len() + offsets.last().unwrap().1 as usize, 0);
    buf
}

fn bench_header(c: &mut Criterion) {
    let buf = thousand_tensor_file();
    let mut g = c.benchmark_group("header");
    g.throughput(Throughput::Elements(1000));
    g.bench_function("parse_and_validate_1000_tensors", |b| {
        b.iter(|| parse_buffer(black_box(&buf)).unwrap())
    });
    g.finish();
}

/// A file with `n` BF16 tensors of `per` bytes each (256 MiB in all).
fn data_file() -> (PathBuf, Vec<String>, usize) {
    let (n, per) = (64usize, 4usize << 20);
    let spec: Vec<(String, Dtype, Vec<u64>)> = (0..n)
        .map(|i| (format!("t{i}"), Dtype::BF16, vec![(per / 2) as u64]))
        .collect();
    let (mut buf, _) = build_header(&spec, None).unwrap();
    buf.extend((0..n * per).map(|i| (i % 251) as u8));
    let path =
        std::env::temp_dir().join(format!("fastload-bench-{}.safetensors", std::process::id()));
    std::fs::File::create(&path)
        .unwrap()
        .write_all(&buf)
        .unwrap();
    (path, spec.into_iter().map(|s| s.0).collect(), n * per)
}

fn bench_copy(c: &mut Criterion) {
    let (path, names, total) = data_file();
    let src = std::fs::read(&path).unwrap();
    let mut g = c.benchmark_group("copy_256MiB");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(total as u64));
    g.bench_function("memcpy_fresh_dst", |b| {
        b.iter(|| {
            // Fresh (unfaulted) memory each iteration, as a loader allocates fresh tensors.
            let mut dst = Box::<[u8]>::new_uninit_slice(total);
            let from = &src[src.len() - total..];
            unsafe {
                std::ptr::copy_nonoverlapping(from.as_ptr(), dst.as_mut_ptr().cast::<u8>(), total)
            };
            black_box(dst);
        })
    });
    let threads = [1, default_threads()];
    for mode in [ReadMode::Pread, ReadMode::Mmap] {
        let file = SafetensorsFile::open(&path, mode).unwrap();
        for &t in threads.iter() {
            for (label, dtype, factor) in [
                ("same_dtype", Dtype::BF16, 1),
                ("bf16_to_f32", Dtype::F32, 2),
            ] {
                let id = BenchmarkId::new(
                    format!("{}_{label}_fresh_dst", mode.name()),
                    format!("{t}_threads"),
                );
                g.bench_function(id, |b| {
                    b.iter(|| {
                        let mut dst = Box::<[u8]>::new_uninit_slice(total * factor);
                        let base = dst.as_mut_ptr().cast::<u8>();
                        let per = total * factor / names.len();
                        let reqs: Vec<Request> = names
                            .iter()
                            .enumerate()
                            .map(|(i, n)| Request {
                                name: n.clone(),
                                ptr: base.wrapping_add(i * per),
                                len: per,
                                dtype,
                                selection: Selection::All,
                            })
                            .collect();
                        unsafe { copy(&file, &reqs, Some(t)) }.unwrap();
                        black_box(dst);
                    })
                });
            }
        }
    }
    g.finish();
    let _ = std::fs::remove_file(path);
}

fn bench_convert(c: &mut Criterion) {
    let n = 16usize << 20; // elements: 32 MiB of BF16/F16 in, 64 MiB of F32 out
    let src: Vec<u8> = (0..2 * n).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; 4 * n]; // faulted in once, reused by every iteration
    let mut g = c.benchmark_group("convert_32MiB");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(dst.len() as u64));
    for (label, from) in [("bf16_to_f32", Dtype::BF16), ("f16_to_f32", Dtype::F16)] {
        g.bench_function(format!("{label}_reused_dst"), |b| {
            b.iter(|| convert(black_box(&src), from, &mut dst, Dtype::F32))
        });
    }
    g.finish();
}

criterion_group!(benches, bench_header, bench_copy, bench_convert);
criterion_main!(benches);
