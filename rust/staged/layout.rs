//! Cutting the wanted byte spans of a file into fills: each one contiguous, aligned file range that
//! fits one slot of the ring.

use crate::error::{Error, Result};

/// A byte span of the file the caller wants (absolute offsets), and the unit it may be cut at:
/// a tensor's element size, or its whole length where it must not be cut (packed sub-byte types).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    pub name: String,
    pub begin: u64,
    pub end: u64,
    pub unit: u64,
}

/// A piece of one span in one fill: bytes `[start, stop)` of span `span` (relative to its
/// `begin`) sit at `slot_offset` in the fill's slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub span: usize,
    pub start: u64,
    pub stop: u64,
    pub slot_offset: u64,
}

/// One slot's worth of reading: the file range `[offset, end)` (`offset` aligned), read into the
/// slot from its first byte, and the pieces of spans it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fill {
    pub offset: u64,
    pub end: u64,
    pub pieces: Vec<Piece>,
}

impl Fill {
    /// Bytes the fill needs read.
    pub fn len(&self) -> u64 {
        self.end - self.offset
    }

    /// Whether the fill holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.end == self.offset
    }
}

fn align_down(x: u64, align: u64) -> u64 {
    x / align * align
}

/// Packs `spans` into fills of at most `slot_bytes` each, in file order. Each fill starts at an
/// offset aligned to `align` (its first piece then lies up to `align - 1` bytes into the slot), so
/// it can be read with direct I/O; a span is cut only at multiples of its `unit`; a fill reads
/// through at most `gap` unwanted bytes between two spans, otherwise the next span starts a fill
/// of its own. Empty spans get no piece.
///
/// Refuses ([`Error::InvalidStaging`]) a unit that cannot fit one slot, naming the span and the slot size
/// it needs, and a span with `end < begin` or a unit of 0.
pub fn layout(spans: &[Span], slot_bytes: u64, align: u64, gap: u64) -> Result<Vec<Fill>> {
    let bad = |name: &str, detail: String| Error::InvalidStaging {
        tensor: Some(name.to_string()),
        detail,
    };
    if align == 0 || slot_bytes == 0 || slot_bytes % align != 0 {
        return Err(Error::InvalidStaging {
            tensor: None,
            detail: format!("staging slot of {slot_bytes} bytes is not a multiple of {align}"),
        });
    }
    for s in spans {
        if s.end < s.begin || s.unit == 0 {
            return Err(bad(
                &s.name,
                format!(
                    "span [{}, {}) with unit {} is not a byte range",
                    s.begin, s.end, s.unit
                ),
            ));
        }
    }
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_by_key(|&i| (spans[i].begin, spans[i].end));
    let mut fills: Vec<Fill> = Vec::new();
    let mut cur: Option<Fill> = None;
    for i in order {
        let s = &spans[i];
        let mut pos = s.begin;
        while pos < s.end {
            // Can the current fill take bytes from `pos` on?
            let joins = cur
                .as_ref()
                .is_some_and(|f| pos >= f.offset && pos <= f.end.saturating_add(gap));
            if !joins {
                if let Some(f) = cur.take() {
                    fills.push(f);
                }
                let offset = align_down(pos, align);
                cur = Some(Fill {
                    offset,
                    end: offset,
                    pieces: Vec::new(),
                });
            }
            let f = cur.as_mut().expect("a fill is open");
            let limit = f.offset + slot_bytes;
            let avail = limit.saturating_sub(pos);
            let left = s.end - pos;
            let take = if left <= avail {
                left
            } else {
                avail / s.unit * s.unit
            };
            if take == 0 {
                if f.pieces.is_empty() {
                    let need = s.unit.min(left) + (pos - f.offset);
                    return Err(bad(
                        &s.name,
                        format!(
                            "a staging slot of {slot_bytes} bytes cannot hold its smallest piece \
                             ({} bytes, {} into an aligned read): staging needs slots of at \
                             least {} bytes",
                            s.unit.min(left),
                            pos - f.offset,
                            need.div_ceil(align) * align
                        ),
                    ));
                }
                // The fill is full: the rest goes to the next one.
                fills.push(cur.take().expect("a fill is open"));
                continue;
            }
            f.pieces.push(Piece {
                span: i,
                start: pos - s.begin,
                stop: pos - s.begin + take,
                slot_offset: pos - f.offset,
            });
            pos += take;
            f.end = f.end.max(pos);
        }
    }
    if let Some(f) = cur {
        if !f.pieces.is_empty() {
            fills.push(f);
        }
    }
    Ok(fills)
}
