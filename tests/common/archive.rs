//! Torch `.pt` and DCP item archives judged independently of reshard's own reader: the `zip`
//! crate reads the directory (names, sizes, method, header and data offsets) and, for an
//! archive read in full, checks every record's CRC-32. The layout rules of torch's writer
//! that any zip reader accepts either way (zip64 end records, data descriptors, the FB padding
//! that aligns data to 64 bytes, records back to back) are checked on the raw bytes at the
//! offsets the crate reports, by [`torch_layout`].

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use zip::read::{ArchiveOffset, Config};
use zip::{CompressionMethod, ZipArchive};

/// Bytes an archive can be read from: a slice, or the sparse pieces of an archive whose data
/// records are never materialized.
pub trait Source {
    /// Length of the archive.
    fn size(&self) -> u64;
    /// `n` bytes at `at`, which must be literal bytes (not a data hole of a [`Sparse`]).
    fn read(&self, at: u64, n: u64) -> Vec<u8>;
    /// Fill `buf` from `at`, holes reading as zeros (what the zip crate reads through).
    fn fill(&self, at: u64, buf: &mut [u8]);
}

impl Source for [u8] {
    fn size(&self) -> u64 {
        self.len() as u64
    }
    fn read(&self, at: u64, n: u64) -> Vec<u8> {
        self[at as usize..(at + n) as usize].to_vec()
    }
    fn fill(&self, at: u64, buf: &mut [u8]) {
        buf.copy_from_slice(&self[at as usize..at as usize + buf.len()]);
    }
}

/// An archive known only by its literal pieces (data records are never materialized).
pub struct Sparse {
    len: u64,
    pieces: BTreeMap<u64, Vec<u8>>,
}

impl Sparse {
    /// An archive of `len` bytes holding `pieces` (offset, bytes) and holes elsewhere.
    pub fn new(len: u64, pieces: Vec<(u64, Vec<u8>)>) -> Sparse {
        Sparse {
            len,
            pieces: pieces.into_iter().collect(),
        }
    }
}

impl Source for Sparse {
    fn size(&self) -> u64 {
        self.len
    }
    fn read(&self, at: u64, n: u64) -> Vec<u8> {
        let (start, piece) = self
            .pieces
            .range(..=at)
            .next_back()
            .unwrap_or_else(|| panic!("read of {n} bytes at {at}: no piece"));
        let off = (at - start) as usize;
        assert!(
            off + n as usize <= piece.len(),
            "read of {n} bytes at {at} leaves the piece at {start} ({} bytes)",
            piece.len()
        );
        piece[off..off + n as usize].to_vec()
    }
    fn fill(&self, at: u64, buf: &mut [u8]) {
        buf.fill(0);
        let end = at + buf.len() as u64;
        for (&start, piece) in self.pieces.range(..end).rev() {
            let piece_end = start + piece.len() as u64;
            if piece_end <= at {
                break;
            }
            let (from, to) = (start.max(at), piece_end.min(end));
            buf[(from - at) as usize..(to - at) as usize]
                .copy_from_slice(&piece[(from - start) as usize..(to - start) as usize]);
        }
    }
}

/// A [`Source`] as `Read + Seek`, for [`ZipArchive`].
struct Reader<'a, S: ?Sized> {
    src: &'a S,
    pos: u64,
}

impl<S: Source + ?Sized> Read for Reader<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (buf.len() as u64).min(self.src.size().saturating_sub(self.pos)) as usize;
        self.src.fill(self.pos, &mut buf[..n]);
        self.pos += n as u64;
        Ok(n)
    }
}

impl<S: Source + ?Sized> Seek for Reader<'_, S> {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        self.pos = match to {
            SeekFrom::Start(n) => n,
            SeekFrom::End(d) => self.src.size().checked_add_signed(d).unwrap(),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d).unwrap(),
        };
        Ok(self.pos)
    }
}

/// One record, as the zip crate reports it.
#[derive(Debug, Clone)]
pub struct Walked {
    pub name: String,
    pub header_offset: u64,
    pub data_offset: u64,
    pub size: u64,
    pub crc: u32,
    /// The directory gives the record a zip64 block (its 32-bit size or offset is saturated).
    pub zip64: bool,
    /// Offset of its central directory header.
    central: u64,
}

/// The zip crate's reader over `src`, the archive starting at byte 0.
fn open<S: Source + ?Sized>(src: &S) -> ZipArchive<Reader<'_, S>> {
    let config = Config {
        archive_offset: ArchiveOffset::Known(0),
    };
    ZipArchive::with_config(config, Reader { src, pos: 0 })
        .unwrap_or_else(|e| panic!("the zip crate cannot read the archive: {e}"))
}

/// The records of `src` in directory order, as the zip crate reads them: each stored (not
/// compressed) with equal sizes and no comment, and the archive without a comment.
fn records<S: Source + ?Sized>(src: &S) -> Vec<Walked> {
    let mut z = open(src);
    assert!(z.comment().is_empty(), "archive comment");
    (0..z.len())
        .map(|i| {
            let f = z.by_index_raw(i).unwrap();
            let name = f.name().to_string();
            assert_eq!(
                f.compression(),
                CompressionMethod::Stored,
                "`{name}` stored"
            );
            assert_eq!(f.compressed_size(), f.size(), "`{name}` sizes");
            assert!(f.comment().is_empty(), "`{name}` comment");
            let c = src.read(f.central_header_start(), 46);
            Walked {
                header_offset: f.header_start(),
                data_offset: f.data_start().expect("data start"),
                size: f.size(),
                crc: f.crc32(),
                zip64: u32le(&c, 20) == u32::MAX || u32le(&c, 42) == u32::MAX,
                central: f.central_header_start(),
                name,
            }
        })
        .collect()
}

/// Read an archive with the zip crate and check torch's layout rules ([`torch_layout`]);
/// data records are not read (a [`Sparse`] archive has none).
pub fn walk<S: Source + ?Sized>(src: &S) -> Vec<Walked> {
    let w = records(src);
    torch_layout(src, &w);
    w
}

/// [`walk`] an in-memory archive, then read every record in full through the zip crate,
/// which checks its CRC-32.
pub fn walk_checked(bytes: &[u8]) -> Vec<Walked> {
    let w = walk(bytes);
    let mut z = open(bytes);
    for (i, e) in w.iter().enumerate() {
        let mut data = vec![];
        z.by_index(i)
            .unwrap()
            .read_to_end(&mut data)
            .unwrap_or_else(|err| panic!("`{}`: {err}", e.name));
        assert_eq!(data, record_data(bytes, &w, &e.name), "`{}` data", e.name);
    }
    w
}

/// The data of record `name`.
pub fn record_data<'a>(bytes: &'a [u8], w: &[Walked], name: &str) -> &'a [u8] {
    let e = w
        .iter()
        .find(|e| e.name == name)
        .unwrap_or_else(|| panic!("no record `{name}`"));
    &bytes[e.data_offset as usize..(e.data_offset + e.size) as usize]
}

/// The `.pt` archive prefix of records like `archive/data.pkl`.
pub fn prefix(w: &[Walked]) -> &str {
    w[0].name.split_once('/').unwrap().0
}

/// Split a `.distcp` file into its back-to-back torch.save items (stopping at anything else,
/// e.g. safetensors-serialized items).
pub fn split_items(bytes: &[u8]) -> Vec<&[u8]> {
    let mut items = vec![];
    let mut start = 0;
    while bytes[start..].starts_with(b"PK\x03\x04") {
        let rel = bytes[start..]
            .windows(4)
            .position(|w| w == b"PK\x05\x06")
            .expect("an EOCD");
        let end = start + rel + 22;
        items.push(&bytes[start..end]);
        start = end;
    }
    items
}

fn u16le(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
pub fn u32le(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64le(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Extra-field blocks `(id, body)`.
fn extra_blocks(extra: &[u8]) -> Vec<(u16, Vec<u8>)> {
    let mut out = vec![];
    let mut at = 0;
    while at < extra.len() {
        let id = u16le(extra, at);
        let n = u16le(extra, at + 2) as usize;
        out.push((id, extra[at + 4..at + 4 + n].to_vec()));
        at += 4 + n;
    }
    assert_eq!(at, extra.len(), "extra field overruns");
    out
}

/// The body of a zip64 block holding (size, size) and/or the header offset.
fn zip64_body(size: Option<u64>, offset: Option<u64>) -> Vec<u8> {
    let sizes = size.map(|s| [s, s]).into_iter().flatten();
    sizes.chain(offset).flat_map(u64::to_le_bytes).collect()
}

/// The structural rules of torch's writer (§3.2) that the zip crate does not check, on the raw
/// bytes at the offsets it reported: zip64 EOCD and locator always, right after the central
/// directory; records contiguous from byte 0; flags 0x0808 (0x0800 without data, no data
/// descriptor, as miniz writes them); local CRC and sizes 0; an FB padding block of `Z`s last,
/// data 64-aligned; data descriptors repeating CRC and sizes; zip64 blocks exactly when a size
/// or an offset needs them.
pub fn torch_layout<S: Source + ?Sized>(src: &S, w: &[Walked]) {
    let len = src.size();
    let eocd = src.read(len - 22, 22);
    assert_eq!(u32le(&eocd, 0), 0x0605_4b50, "EOCD signature");
    assert_eq!(u16le(&eocd, 20), 0, "no comment");
    let loc = src.read(len - 42, 20);
    assert_eq!(u32le(&loc, 0), 0x0706_4b50, "zip64 locator signature");
    assert_eq!(u32le(&loc, 4), 0);
    assert_eq!(u32le(&loc, 16), 1);
    let z64_off = u64le(&loc, 8);
    assert_eq!(
        z64_off + 56,
        len - 42,
        "zip64 EOCD right before the locator"
    );
    let z = src.read(z64_off, 56);
    assert_eq!(u32le(&z, 0), 0x0606_4b50, "zip64 EOCD signature");
    assert_eq!(u64le(&z, 4), 44);
    let count = u64le(&z, 24);
    assert_eq!(u64le(&z, 32), count);
    assert_eq!(count, w.len() as u64, "records the zip crate lists");
    let (cd_size, cd_off) = (u64le(&z, 40), u64le(&z, 48));
    assert_eq!(
        cd_off + cd_size,
        z64_off,
        "central directory right before zip64 EOCD"
    );
    let sat16 = |x: u64| x.min(0xFFFF) as u16;
    let sat32 = |x: u64| x.min(0xFFFF_FFFF) as u32;
    assert_eq!(u16le(&eocd, 8), sat16(count));
    assert_eq!(u16le(&eocd, 10), sat16(count));
    assert_eq!(u32le(&eocd, 12), sat32(cd_size));
    assert_eq!(u32le(&eocd, 16), sat32(cd_off));

    let (mut expected_header, mut p) = (0u64, cd_off);
    for e in w {
        let name = &e.name;
        // Central header: no extra but the zip64 block, and that only when needed.
        assert_eq!(e.central, p, "directory entries in order");
        let c = src.read(p, 46);
        let (nl, el) = (u16le(&c, 28) as u64, u16le(&c, 30) as u64);
        assert_eq!(u32le(&c, 20), u32le(&c, 24), "`{name}` sizes");
        let big = e.size >= 0xFFFF_FFFF;
        let far = e.header_offset >= 0xFFFF_FFFF;
        assert_eq!(e.zip64, big || far, "`{name}`: zip64 exactly when needed");
        let zip64_block = |body: Vec<u8>| {
            let mut b = vec![1, 0];
            b.extend((body.len() as u16).to_le_bytes());
            b.extend(body);
            b
        };
        let body = zip64_body(big.then_some(e.size), far.then_some(e.header_offset));
        let want = if e.zip64 {
            zip64_block(body.clone())
        } else {
            vec![]
        };
        assert_eq!(src.read(p + 46 + nl, el), want, "`{name}`: directory extra");
        // Local header.
        assert_eq!(e.header_offset, expected_header, "records are contiguous");
        let h = src.read(e.header_offset, 30);
        let want_flags = if e.size == 0 { 0x0800 } else { 0x0808 };
        assert_eq!(u16le(&c, 8), want_flags, "central flags of `{name}`");
        assert_eq!(u16le(&h, 6), want_flags, "local flags of `{name}`");
        assert_eq!(u16le(&h, 8), 0, "stored");
        assert_eq!(&h[14..26], &[0u8; 12], "local crc and sizes are 0");
        let (lnl, lel) = (u16le(&h, 26) as u64, u16le(&h, 28) as u64);
        assert_eq!(src.read(e.header_offset + 30, lnl), name.as_bytes());
        let mut blocks = extra_blocks(&src.read(e.header_offset + 30 + lnl, lel));
        let (fb_id, fb) = blocks.pop().expect("FB block");
        assert_eq!(fb_id, 0x4246, "FB padding block comes last");
        assert!(fb.iter().all(|&b| b == b'Z'));
        let want: Vec<_> = e.zip64.then_some((1, body)).into_iter().collect();
        assert_eq!(blocks, want, "`{name}`: local zip64 block");
        assert_eq!(e.data_offset, e.header_offset + 30 + lnl + lel);
        assert_eq!(
            e.data_offset % 64,
            0,
            "`{name}` data at {} is not 64-aligned",
            e.data_offset
        );
        // Data descriptor.
        let dl = match (e.size, e.zip64) {
            (0, _) => {
                assert_eq!(e.crc, 0);
                0
            }
            (_, true) => 24,
            _ => 16,
        };
        if dl > 0 {
            let d = src.read(e.data_offset + e.size, dl);
            assert_eq!(u32le(&d, 0), 0x0807_4b50, "descriptor signature");
            assert_eq!(u32le(&d, 4), e.crc, "descriptor crc = directory crc");
            let sizes = if e.zip64 {
                (u64le(&d, 8), u64le(&d, 16))
            } else {
                (u32le(&d, 8) as u64, u32le(&d, 12) as u64)
            };
            assert_eq!(sizes, (e.size, e.size));
        }
        expected_header = e.data_offset + e.size + dl;
        p += 46 + nl + el;
    }
    assert_eq!(
        expected_header, cd_off,
        "directory right after the last record"
    );
    assert_eq!(p, cd_off + cd_size, "directory size");
}
