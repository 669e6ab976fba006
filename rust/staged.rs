//! The staged read pipeline of accelerator loads: contiguous file ranges read into a ring of
//! caller-owned slots (pinned host memory, for a GPU), many reads in flight, each slot handed to
//! the consumer (the host-to-device copy) the moment its reads complete.
//!
//! Bytes, not tensors: [`layout`] packs the byte spans the caller wants (tensors, or whole pieces
//! of them) into *fills*, each one contiguous range of the file that fits one slot; a large tensor
//! is cut across fills at element boundaries, small neighbours share one fill. [`Ring`] then reads
//! the fills in order on threads of its own, in [`CHUNK`]-sized reads, as far ahead as free slots
//! allow: the storage sees a steady queue of `threads` reads, not one burst per buffer, and the
//! consumer never waits for a read it could have had earlier.
//!
//! * `layout`: the spans cut and packed into fills ([`layout`], [`Fill`], [`Piece`]).
//! * `ring`: the reading threads and the slot hand-over ([`Ring`]).
//! * `direct`: reads that bypass the page cache (`O_DIRECT`), for ranges not already cached.

mod direct;
mod layout;
mod ring;

pub use layout::{layout, Fill, Piece, Span};
pub use ring::{Ring, RingOptions, RingStats};

/// Alignment of direct reads (file offset, length and memory address): the logical block size of
/// every filesystem and device fastload meets (512 or 4096 bytes).
pub const ALIGN: u64 = 4096;

/// Bytes of one read: large enough that the device streams, small enough that every slot is
/// served by several threads at once.
pub const CHUNK: u64 = 8 << 20;

/// Unwanted bytes a fill reads through rather than start a new slot (a tensor not asked for,
/// between two that are): cheaper than a slot left mostly empty.
pub const GAP: u64 = 64 << 10;

#[cfg(test)]
mod tests;
