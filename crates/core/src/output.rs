//! The description of an output: the files a writer lays out ([`OutputFile`]: path, size,
//! bytes written verbatim, and the CRC-32s to compute over the finished bytes) — what the
//! formats produce and the executor writes. Nothing here writes a byte.

use std::path::PathBuf;
use std::sync::Arc;

/// Bytes an output file holds verbatim (headers), shared where outputs repeat them: every
/// DCP item of one dtype and shape has the same header bytes.
pub type Literal = Arc<[u8]>;

/// A destination file: where it goes, its final size, and bytes written verbatim (headers).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputFile {
    /// Path relative to the destination (a file name for a single-file output).
    pub path: PathBuf,
    /// Final size in bytes.
    pub size: u64,
    /// `(offset, bytes)` written verbatim.
    pub literals: Vec<(u64, Literal)>,
    /// CRC-32s to compute over the finished file and write in place (zip records).
    pub checksums: Vec<Checksum>,
}

/// The CRC-32 of bytes `range` of an output file, written at each offset of `at` (which must
/// lie outside `range`) — 4 bytes little-endian (zip records), or as 8 lowercase hex digits
/// when `hex` (a safetensors header) — once every copy and literal is in place. It is
/// computed while the bytes stream: each window hashes its share of the range (from its
/// buffer, or straight from the source mapping for kernel-copied runs) and the shares are
/// joined in order with `crc32fast`'s `combine`; the output is never read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checksum {
    /// First and past-the-last byte covered.
    pub range: (u64, u64),
    /// Where to write the CRC.
    pub at: Vec<u64>,
    /// Write it as 8 lowercase hex digits instead of 4 little-endian bytes.
    pub hex: bool,
}

/// Lower-case hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes of a hex string, `None` when it is not one.
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}
