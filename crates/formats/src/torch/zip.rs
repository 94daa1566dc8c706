//! The zip container of `torch.save` archives (`docs/pytorch-formats.md` §3.2–3.4): its binary
//! records as named structs, each parsed from and written to bytes in one place
//! ([`LocalHeader`], [`CentralHeader`], [`DataDescriptor`], [`EndOfCentralDirectory`],
//! [`Zip64EndOfCentralDirectory`], [`Zip64Locator`], [`Zip64Extra`]); reading an archive held
//! in a byte slice ([`Archive`]); and laying out and writing one the way torch's own writer
//! (miniz) does ([`layout_archive`], [`archive_bytes`]).
//!
//! # Reading
//!
//! The archive is read from its end: the end-of-central-directory record (and the zip64
//! record when a field is saturated), then the central directory. Local headers carry no
//! sizes in torch archives (data descriptors follow the data), so sizes always come from the
//! central directory, and a record's data offset is `local header + 30 + name length + extra
//! length` with the lengths of the *local* header (torch pads there, not in the directory).
//! Records must be stored (method 0). Nothing here panics on any input, and nothing is
//! allocated from a length field before that field has been checked against the slice.
//!
//! # Writing
//!
//! Archives are laid out before any tensor data exists, so an executor can write the data
//! records in place. Every record is stored (method 0); local headers carry flags `0x0808`
//! (data descriptor + UTF-8) and crc/sizes 0; a `0x4246` ("FB") extra block filled with `'Z'`
//! pads every record so its data starts at a multiple of 64 bytes *relative to the archive
//! start*; a data descriptor follows each record's data (empty records have flags `0x0800` and
//! no descriptor, like miniz writes them); the central directory holds the real CRC-32s; the
//! zip64 end-of-central-directory record and locator are always written before the classic
//! one. Records of 4 GiB or more, and records whose local header lies at 4 GiB or more, get
//! zip64 extras (local header: `0x0001` block with usize/csize and/or the header offset,
//! before the FB block, sizes left 0; 24-byte data descriptor; central directory: standard
//! zip64 extra for the saturated fields).
//!
//! A caller that streams tensor data writes [`archive_bytes`] with a CRC of 0 for the data
//! records, writes the data at [`ArchiveLayout::data_offsets`], then patches the 4-byte CRC
//! fields at [`crc_offsets`] (or calls `fill_crcs`, which reads the data back and does it).
//! [`output_parts`] packages the literals and those CRC patches for the executor
//! ([`reshard_core::output::OutputFile::literals`] and [`reshard_core::output::OutputFile::checksums`]).
//! torch's reader skips CRC checks, so an archive with CRC 0 already loads; standard zip tools
//! need the real values.

use super::pickle;
use super::short;

// ---------------------------------------------------------------------------------------------
// Records

fn put16(w: &mut Vec<u8>, x: u16) {
    w.extend_from_slice(&x.to_le_bytes());
}

fn put32(w: &mut Vec<u8>, x: u32) {
    w.extend_from_slice(&x.to_le_bytes());
}

fn put64(w: &mut Vec<u8>, x: u64) {
    w.extend_from_slice(&x.to_le_bytes());
}

/// Little-endian fields read in order from a record whose length was checked; a read past
/// the end gives 0 (never happens after [`Fields::record`]), so parsing stays total.
struct Fields<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Fields<'a> {
    /// The fields after the 4-byte signature of a record of `len` bytes at the start of `b`;
    /// `None` when `b` is shorter or does not start with `signature`.
    fn record(b: &'a [u8], len: u64, signature: u32) -> Option<Fields<'a>> {
        let b = b.get(..usize::try_from(len).ok()?)?;
        let mut f = Fields { b, at: 0 };
        (f.u32() == signature).then_some(f)
    }

    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut a = [0u8; N];
        if let Some(s) = self.b.get(self.at..self.at.saturating_add(N)) {
            a.copy_from_slice(s);
        }
        self.at = self.at.saturating_add(N);
        a
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }

    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
}

/// `len` bytes at `at` of `b`, if they lie inside it.
fn bytes_at(b: &[u8], at: u64, len: u64) -> Option<&[u8]> {
    let start = usize::try_from(at).ok()?;
    let end = start.checked_add(usize::try_from(len).ok()?)?;
    b.get(start..end)
}

/// The bytes of `b` from `at` on (empty past the end).
fn from(b: &[u8], at: u64) -> &[u8] {
    usize::try_from(at)
        .ok()
        .and_then(|a| b.get(a..))
        .unwrap_or_default()
}

/// A local file header (30 bytes, then the name and the extra field).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalHeader {
    /// Version needed to extract.
    pub version_needed: u16,
    /// General-purpose flags.
    pub flags: u16,
    /// Compression method (0: stored).
    pub method: u16,
    /// DOS modification time.
    pub mod_time: u16,
    /// DOS modification date.
    pub mod_date: u16,
    /// CRC-32 of the data (0 when a data descriptor carries it).
    pub crc32: u32,
    /// Compressed size (0 when a data descriptor carries it).
    pub compressed_size: u32,
    /// Uncompressed size (0 when a data descriptor carries it).
    pub uncompressed_size: u32,
    /// Length of the name that follows.
    pub name_len: u16,
    /// Length of the extra field after the name.
    pub extra_len: u16,
}

impl LocalHeader {
    /// `PK\x03\x04`.
    pub const SIGNATURE: u32 = 0x0403_4b50;
    /// Bytes of the fixed part.
    pub const LEN: u64 = 30;

    /// The header at the start of `b`; `None` when `b` is shorter or the signature differs.
    pub fn parse(b: &[u8]) -> Option<LocalHeader> {
        let mut f = Fields::record(b, Self::LEN, Self::SIGNATURE)?;
        Some(LocalHeader {
            version_needed: f.u16(),
            flags: f.u16(),
            method: f.u16(),
            mod_time: f.u16(),
            mod_date: f.u16(),
            crc32: f.u32(),
            compressed_size: f.u32(),
            uncompressed_size: f.u32(),
            name_len: f.u16(),
            extra_len: f.u16(),
        })
    }

    /// Append the fixed part (the caller appends the name and the extra field).
    pub fn write(&self, w: &mut Vec<u8>) {
        put32(w, Self::SIGNATURE);
        put16(w, self.version_needed);
        put16(w, self.flags);
        put16(w, self.method);
        put16(w, self.mod_time);
        put16(w, self.mod_date);
        put32(w, self.crc32);
        put32(w, self.compressed_size);
        put32(w, self.uncompressed_size);
        put16(w, self.name_len);
        put16(w, self.extra_len);
    }
}

/// A central-directory file header (46 bytes, then the name, extra field and comment).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CentralHeader {
    /// Version made by.
    pub version_made_by: u16,
    /// Version needed to extract.
    pub version_needed: u16,
    /// General-purpose flags (bit 0: encrypted).
    pub flags: u16,
    /// Compression method (0: stored).
    pub method: u16,
    /// DOS modification time.
    pub mod_time: u16,
    /// DOS modification date.
    pub mod_date: u16,
    /// CRC-32 of the data.
    pub crc32: u32,
    /// Compressed size, `0xFFFFFFFF` when in the zip64 extra.
    pub compressed_size: u32,
    /// Uncompressed size, `0xFFFFFFFF` when in the zip64 extra.
    pub uncompressed_size: u32,
    /// Length of the name.
    pub name_len: u16,
    /// Length of the extra field.
    pub extra_len: u16,
    /// Length of the comment.
    pub comment_len: u16,
    /// Disk number where the record starts.
    pub disk_start: u16,
    /// Internal file attributes.
    pub internal_attributes: u16,
    /// External file attributes.
    pub external_attributes: u32,
    /// Offset of the local header, `0xFFFFFFFF` when in the zip64 extra.
    pub header_offset: u32,
}

impl CentralHeader {
    /// `PK\x01\x02`.
    pub const SIGNATURE: u32 = 0x0201_4b50;
    /// Bytes of the fixed part.
    pub const LEN: u64 = 46;
    /// Offset of the CRC-32 field in the header.
    pub const CRC_OFFSET: u64 = 16;

    /// The header at the start of `b`; `None` when `b` is shorter or the signature differs.
    pub fn parse(b: &[u8]) -> Option<CentralHeader> {
        let mut f = Fields::record(b, Self::LEN, Self::SIGNATURE)?;
        Some(CentralHeader {
            version_made_by: f.u16(),
            version_needed: f.u16(),
            flags: f.u16(),
            method: f.u16(),
            mod_time: f.u16(),
            mod_date: f.u16(),
            crc32: f.u32(),
            compressed_size: f.u32(),
            uncompressed_size: f.u32(),
            name_len: f.u16(),
            extra_len: f.u16(),
            comment_len: f.u16(),
            disk_start: f.u16(),
            internal_attributes: f.u16(),
            external_attributes: f.u32(),
            header_offset: f.u32(),
        })
    }

    /// Bytes of the name, extra field and comment after the fixed part.
    pub fn var_len(&self) -> u64 {
        self.name_len as u64 + self.extra_len as u64 + self.comment_len as u64
    }

    /// Append the fixed part (the caller appends the name, extra field and comment).
    pub fn write(&self, w: &mut Vec<u8>) {
        put32(w, Self::SIGNATURE);
        put16(w, self.version_made_by);
        put16(w, self.version_needed);
        put16(w, self.flags);
        put16(w, self.method);
        put16(w, self.mod_time);
        put16(w, self.mod_date);
        put32(w, self.crc32);
        put32(w, self.compressed_size);
        put32(w, self.uncompressed_size);
        put16(w, self.name_len);
        put16(w, self.extra_len);
        put16(w, self.comment_len);
        put16(w, self.disk_start);
        put16(w, self.internal_attributes);
        put32(w, self.external_attributes);
        put32(w, self.header_offset);
    }
}

/// The data descriptor after a record's data (flag bit 3): CRC-32 and sizes, 32-bit (16
/// bytes) or, for zip64 records, 64-bit (24 bytes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DataDescriptor {
    /// CRC-32 of the data.
    pub crc32: u32,
    /// Compressed size.
    pub compressed_size: u64,
    /// Uncompressed size.
    pub uncompressed_size: u64,
    /// 64-bit sizes.
    pub zip64: bool,
}

impl DataDescriptor {
    /// `PK\x07\x08`.
    pub const SIGNATURE: u32 = 0x0807_4b50;
    /// Offset of the CRC-32 field in the descriptor.
    pub const CRC_OFFSET: u64 = 4;

    /// Bytes of a descriptor with 64-bit sizes or not.
    pub fn len(zip64: bool) -> u64 {
        if zip64 {
            24
        } else {
            16
        }
    }

    /// The descriptor (with its signature) at the start of `b`.
    #[cfg(any(test, feature = "internals"))]
    pub fn parse(b: &[u8], zip64: bool) -> Option<DataDescriptor> {
        let mut f = Fields::record(b, Self::len(zip64), Self::SIGNATURE)?;
        let crc32 = f.u32();
        let (compressed_size, uncompressed_size) = if zip64 {
            (f.u64(), f.u64())
        } else {
            (f.u32() as u64, f.u32() as u64)
        };
        Some(DataDescriptor {
            crc32,
            compressed_size,
            uncompressed_size,
            zip64,
        })
    }

    /// Append the descriptor (sizes truncated to 32 bits unless `zip64`).
    pub fn write(&self, w: &mut Vec<u8>) {
        put32(w, Self::SIGNATURE);
        put32(w, self.crc32);
        if self.zip64 {
            put64(w, self.compressed_size);
            put64(w, self.uncompressed_size);
        } else {
            put32(w, self.compressed_size as u32);
            put32(w, self.uncompressed_size as u32);
        }
    }
}

/// The classic end-of-central-directory record (22 bytes, then a comment).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndOfCentralDirectory {
    /// Number of this disk.
    pub disk: u16,
    /// Disk where the central directory starts.
    pub cd_disk: u16,
    /// Records on this disk (`0xFFFF`: see the zip64 record).
    pub entries_on_disk: u16,
    /// Records in total (`0xFFFF`: see the zip64 record).
    pub entries: u16,
    /// Bytes of the central directory (`0xFFFFFFFF`: see the zip64 record).
    pub cd_size: u32,
    /// Offset of the central directory (`0xFFFFFFFF`: see the zip64 record).
    pub cd_offset: u32,
    /// Length of the comment that follows.
    pub comment_len: u16,
}

impl EndOfCentralDirectory {
    /// `PK\x05\x06`.
    pub const SIGNATURE: u32 = 0x0605_4b50;
    /// Bytes of the fixed part.
    pub const LEN: u64 = 22;

    /// The record at the start of `b`; `None` when `b` is shorter or the signature differs.
    pub fn parse(b: &[u8]) -> Option<EndOfCentralDirectory> {
        let mut f = Fields::record(b, Self::LEN, Self::SIGNATURE)?;
        Some(EndOfCentralDirectory {
            disk: f.u16(),
            cd_disk: f.u16(),
            entries_on_disk: f.u16(),
            entries: f.u16(),
            cd_size: f.u32(),
            cd_offset: f.u32(),
            comment_len: f.u16(),
        })
    }

    /// True when a field is saturated, so the zip64 record holds the real values.
    pub fn needs_zip64(&self) -> bool {
        self.entries == 0xFFFF || self.cd_size == u32::MAX || self.cd_offset == u32::MAX
    }

    /// Append the record (the caller appends the comment).
    pub fn write(&self, w: &mut Vec<u8>) {
        put32(w, Self::SIGNATURE);
        put16(w, self.disk);
        put16(w, self.cd_disk);
        put16(w, self.entries_on_disk);
        put16(w, self.entries);
        put32(w, self.cd_size);
        put32(w, self.cd_offset);
        put16(w, self.comment_len);
    }
}

/// The zip64 end-of-central-directory record (56 bytes, no extensible data).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Zip64EndOfCentralDirectory {
    /// Bytes of the record after this field (44).
    pub record_size: u64,
    /// Version made by.
    pub version_made_by: u16,
    /// Version needed to extract.
    pub version_needed: u16,
    /// Number of this disk.
    pub disk: u32,
    /// Disk where the central directory starts.
    pub cd_disk: u32,
    /// Records on this disk.
    pub entries_on_disk: u64,
    /// Records in total.
    pub entries: u64,
    /// Bytes of the central directory.
    pub cd_size: u64,
    /// Offset of the central directory.
    pub cd_offset: u64,
}

impl Zip64EndOfCentralDirectory {
    /// `PK\x06\x06`.
    pub const SIGNATURE: u32 = 0x0606_4b50;
    /// Bytes of the record.
    pub const LEN: u64 = 56;

    /// The record at the start of `b`; `None` when `b` is shorter or the signature differs.
    pub fn parse(b: &[u8]) -> Option<Zip64EndOfCentralDirectory> {
        let mut f = Fields::record(b, Self::LEN, Self::SIGNATURE)?;
        Some(Zip64EndOfCentralDirectory {
            record_size: f.u64(),
            version_made_by: f.u16(),
            version_needed: f.u16(),
            disk: f.u32(),
            cd_disk: f.u32(),
            entries_on_disk: f.u64(),
            entries: f.u64(),
            cd_size: f.u64(),
            cd_offset: f.u64(),
        })
    }

    /// Append the record.
    pub fn write(&self, w: &mut Vec<u8>) {
        put32(w, Self::SIGNATURE);
        put64(w, self.record_size);
        put16(w, self.version_made_by);
        put16(w, self.version_needed);
        put32(w, self.disk);
        put32(w, self.cd_disk);
        put64(w, self.entries_on_disk);
        put64(w, self.entries);
        put64(w, self.cd_size);
        put64(w, self.cd_offset);
    }
}

/// The zip64 end-of-central-directory locator (20 bytes, right before the classic record).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Zip64Locator {
    /// Disk holding the zip64 record.
    pub eocd_disk: u32,
    /// Offset of the zip64 record.
    pub eocd_offset: u64,
    /// Number of disks.
    pub disks: u32,
}

impl Zip64Locator {
    /// `PK\x06\x07`.
    pub const SIGNATURE: u32 = 0x0706_4b50;
    /// Bytes of the locator.
    pub const LEN: u64 = 20;

    /// The locator at the start of `b`; `None` when `b` is shorter or the signature differs.
    pub fn parse(b: &[u8]) -> Option<Zip64Locator> {
        let mut f = Fields::record(b, Self::LEN, Self::SIGNATURE)?;
        Some(Zip64Locator {
            eocd_disk: f.u32(),
            eocd_offset: f.u64(),
            disks: f.u32(),
        })
    }

    /// Append the locator.
    pub fn write(&self, w: &mut Vec<u8>) {
        put32(w, Self::SIGNATURE);
        put32(w, self.eocd_disk);
        put64(w, self.eocd_offset);
        put32(w, self.disks);
    }
}

/// The zip64 extended-information block (id `0x0001`) of an extra field: the 64-bit values
/// of the saturated 32-bit fields, in this order, each present only when saturated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Zip64Extra {
    /// Uncompressed size.
    pub size: Option<u64>,
    /// Compressed size.
    pub compressed_size: Option<u64>,
    /// Local header offset.
    pub header_offset: Option<u64>,
}

impl Zip64Extra {
    /// Block id.
    pub const ID: u16 = 0x0001;

    /// The body of the first zip64 block of `extra` (a whole extra field).
    pub fn find(extra: &[u8]) -> Option<&[u8]> {
        let mut at = 0u64;
        loop {
            let mut f = Fields {
                b: bytes_at(extra, at, 4)?,
                at: 0,
            };
            let (id, n) = (f.u16(), f.u16());
            let body = bytes_at(extra, at + 4, n as u64)?;
            if id == Self::ID {
                return Some(body);
            }
            at += 4 + n as u64;
        }
    }

    /// Read from `body` the values of the fields flagged as saturated, in order; the error
    /// names the first one missing (`size`, `compressed size`, `local header offset`).
    pub fn parse(
        body: &[u8],
        size: bool,
        compressed_size: bool,
        header_offset: bool,
    ) -> Result<Zip64Extra, &'static str> {
        let mut at = 0;
        let mut next = |want: bool, what: &'static str| -> Result<Option<u64>, &'static str> {
            if !want {
                return Ok(None);
            }
            let v = bytes_at(body, at, 8).ok_or(what)?;
            at += 8;
            Ok(Some(Fields { b: v, at: 0 }.u64()))
        };
        Ok(Zip64Extra {
            size: next(size, "size")?,
            compressed_size: next(compressed_size, "compressed size")?,
            header_offset: next(header_offset, "local header offset")?,
        })
    }

    /// Bytes of the body.
    pub fn body_len(&self) -> u16 {
        8 * (self.size.is_some() as u16
            + self.compressed_size.is_some() as u16
            + self.header_offset.is_some() as u16)
    }

    /// Append the block (id, length, body).
    pub fn write(&self, w: &mut Vec<u8>) {
        put16(w, Self::ID);
        put16(w, self.body_len());
        for v in [self.size, self.compressed_size, self.header_offset]
            .into_iter()
            .flatten()
        {
            put64(w, v);
        }
    }
}

/// Id of torch's padding block (`"FB"`), which aligns record data.
pub const PADDING_ID: u16 = 0x4246;

/// Append a padding block with a body of `len` bytes `'Z'`, as torch writes it.
pub fn write_padding(w: &mut Vec<u8>, len: u16) {
    put16(w, PADDING_ID);
    put16(w, len);
    w.resize(w.len() + len as usize, b'Z');
}

// ---------------------------------------------------------------------------------------------
// Reading

/// Why a torch.save archive could not be read. Every message is one short line.
#[derive(Debug, thiserror::Error)]
pub enum TorchZipError {
    /// No end-of-central-directory record at the end of the slice: the archive was cut
    /// short, or the bytes are no zip archive.
    #[error("is truncated or not a torch.save archive (no zip end record)")]
    NoEndOfCentralDirectory,
    /// A structural problem of the zip container.
    #[error("{0}")]
    Zip(String),
    /// A record that is not stored.
    #[error("zip record `{name}` is compressed (method {method})")]
    Compressed {
        /// Record name.
        name: String,
        /// Compression method.
        method: u16,
    },
    /// A record that the archive should hold and does not.
    #[error("zip has no record `{0}`")]
    MissingRecord(String),
    /// `data.pkl` could not be decoded.
    #[error("`{record}`: {source}")]
    Pickle {
        /// The record name.
        record: String,
        /// The pickle error.
        source: pickle::PickleError,
    },
    /// A tensor rebuild call that does not describe a readable tensor.
    #[error("{0}")]
    Tensor(String),
}

/// Results of reading an archive.
pub type Result<T, E = TorchZipError> = std::result::Result<T, E>;

/// A [`TorchZipError::Zip`] saying `msg`.
pub fn zip_err(msg: impl Into<String>) -> TorchZipError {
    TorchZipError::Zip(msg.into())
}

/// One central-directory entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Record name (`archive/data.pkl`).
    pub name: String,
    /// Offset of the record's local header in the slice.
    pub header_offset: u64,
    /// Size of the record's data (stored, so compressed = uncompressed).
    pub size: u64,
    /// CRC-32 from the central directory (0 when the writer did not compute it).
    pub crc: u32,
}

/// Where a record's data lies in the slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordSpan {
    /// Offset of the first data byte in the slice.
    pub offset: u64,
    /// Data length.
    pub len: u64,
}

/// The central directory of one archive.
#[derive(Clone, Debug)]
pub struct Archive {
    /// The archive name: the first record's name up to `/` (`archive` for DCP items, the
    /// file stem, e.g. `meta`, for files saved to a path).
    pub prefix: String,
    /// Entries in central-directory order.
    pub entries: Vec<Entry>,
    /// Indices into `entries` sorted by name (names are distinct), so that looking up every
    /// storage of an archive of many records stays `n log n` — with no hashing or copy of
    /// a name, which a million small DCP items would each pay.
    by_name: Vec<u32>,
    /// Where the central directory starts; all record data lies before it.
    cd_offset: u64,
}

/// Where the central directory of the archive in `bytes` lies (offset, length), read from
/// its end records alone: what a reader fetching an archive piecewise reads second.
pub fn directory_span(bytes: &[u8]) -> Result<(u64, u64)> {
    let (eocd, end) = find_end(bytes)?;
    let dir = directory(bytes, eocd, &end)?;
    Ok((dir.offset, dir.size))
}

/// Where the central directory lies, per the end records.
struct Directory {
    count: u64,
    size: u64,
    offset: u64,
    /// Where the directory must end by: the first end record.
    limit: u64,
}

/// Find the classic end record: the last record, followed by its comment of up to 65535
/// bytes exactly to the end of the slice. Returns its offset.
fn find_end(bytes: &[u8]) -> Result<(u64, EndOfCentralDirectory)> {
    let len = bytes.len() as u64;
    let eocd_len = EndOfCentralDirectory::LEN;
    if len < eocd_len {
        return Err(TorchZipError::NoEndOfCentralDirectory);
    }
    let lowest = len.saturating_sub(eocd_len + 0xFFFF);
    let mut pos = len - eocd_len;
    loop {
        if let Some(e) = EndOfCentralDirectory::parse(from(bytes, pos)) {
            if pos + eocd_len + e.comment_len as u64 == len {
                return Ok((pos, e));
            }
        }
        if pos == lowest {
            return Err(TorchZipError::NoEndOfCentralDirectory);
        }
        pos -= 1;
    }
}

/// The directory's place from the end record at `eocd` (and the zip64 record when a field
/// of the classic one is saturated), checked to lie before the end records.
fn directory(bytes: &[u8], eocd: u64, end: &EndOfCentralDirectory) -> Result<Directory> {
    let mut dir = Directory {
        count: end.entries as u64,
        size: end.cd_size as u64,
        offset: end.cd_offset as u64,
        limit: eocd,
    };
    if end.needs_zip64() {
        let loc = eocd
            .checked_sub(Zip64Locator::LEN)
            .and_then(|l| Zip64Locator::parse(from(bytes, l)).map(|z| (l, z)));
        let Some((loc, locator)) = loc else {
            return Err(zip_err("zip64 end of central directory locator not found"));
        };
        let z = locator.eocd_offset;
        let z64 = z
            .checked_add(Zip64EndOfCentralDirectory::LEN)
            .filter(|&e| e <= loc)
            .and_then(|_| Zip64EndOfCentralDirectory::parse(from(bytes, z)))
            .ok_or_else(|| zip_err("zip64 end of central directory not found"))?;
        dir = Directory {
            count: z64.entries,
            size: z64.cd_size,
            offset: z64.cd_offset,
            limit: z,
        };
    }
    let (size, offset) = (dir.size, dir.offset);
    if offset.checked_add(size).is_none_or(|e| e > dir.limit) {
        return Err(zip_err(format!(
            "central directory ({size} bytes at {offset}) lies outside the archive"
        )));
    }
    if dir.count > size / CentralHeader::LEN {
        return Err(zip_err(format!(
            "central directory claims {} records in {size} bytes",
            dir.count
        )));
    }
    Ok(dir)
}

/// Read central-directory record `i` at `p` (the directory ends at `cd_end`); returns the
/// entry and the offset of the next record.
fn read_entry(bytes: &[u8], i: u64, p: u64, cd_end: u64) -> Result<(Entry, u64)> {
    let truncated = || zip_err(format!("central directory record {i} is truncated"));
    let fixed = bytes_at(bytes, p, CentralHeader::LEN)
        .filter(|_| p + CentralHeader::LEN <= cd_end)
        .ok_or_else(truncated)?;
    let h = CentralHeader::parse(fixed)
        .ok_or_else(|| zip_err(format!("central directory record {i} has a bad signature")))?;
    let var = p + CentralHeader::LEN;
    if var + h.var_len() > cd_end {
        return Err(truncated());
    }
    let name_len = h.name_len as u64;
    let raw_name = bytes_at(bytes, var, name_len).unwrap_or_default();
    let name = std::str::from_utf8(raw_name)
        .map_err(|_| zip_err(format!("zip record {i} has a name that is not UTF-8")))?
        .to_string();
    let extra = bytes_at(bytes, var + name_len, h.extra_len as u64).unwrap_or_default();
    let (mut size, mut csize, mut lho) = (
        h.uncompressed_size as u64,
        h.compressed_size as u64,
        h.header_offset as u64,
    );
    let saturated =
        [h.uncompressed_size, h.compressed_size, h.header_offset].map(|x| x == u32::MAX);
    if saturated.contains(&true) {
        let body = Zip64Extra::find(extra).ok_or_else(|| {
            zip_err(format!(
                "zip record `{}` has saturated sizes but no zip64 extra field",
                short(&name)
            ))
        })?;
        let z =
            Zip64Extra::parse(body, saturated[0], saturated[1], saturated[2]).map_err(|what| {
                zip_err(format!(
                    "zip record `{}`: zip64 extra field lacks the {what}",
                    short(&name)
                ))
            })?;
        size = z.size.unwrap_or(size);
        csize = z.compressed_size.unwrap_or(csize);
        lho = z.header_offset.unwrap_or(lho);
    }
    if h.method != 0 {
        return Err(TorchZipError::Compressed {
            name: short(&name),
            method: h.method,
        });
    }
    if h.flags & 1 != 0 {
        return Err(zip_err(format!(
            "zip record `{}` is encrypted",
            short(&name)
        )));
    }
    if csize != size {
        return Err(zip_err(format!(
            "zip record `{}` is stored but its sizes differ ({csize} and {size})",
            short(&name)
        )));
    }
    let entry = Entry {
        name,
        header_offset: lho,
        size,
        crc: h.crc32,
    };
    Ok((entry, var + h.var_len()))
}

impl Archive {
    /// Read the end records and the central directory of the archive in `bytes`.
    pub fn parse(bytes: &[u8]) -> Result<Archive> {
        let (eocd, end) = find_end(bytes)?;
        let dir = directory(bytes, eocd, &end)?;
        let cd_end = dir.offset + dir.size;
        let mut entries = Vec::with_capacity(dir.count as usize);
        let mut p = dir.offset;
        for i in 0..dir.count {
            let (entry, next) = read_entry(bytes, i, p, cd_end)?;
            entries.push(entry);
            p = next;
        }
        let prefix = match entries.first() {
            None => return Err(zip_err("zip archive has no records")),
            Some(e) => match e.name.split_once('/') {
                Some((pre, _)) if !pre.is_empty() => pre.to_string(),
                _ => {
                    return Err(zip_err(format!(
                        "zip record `{}` has no archive prefix",
                        short(&e.name)
                    )))
                }
            },
        };
        let n = u32::try_from(entries.len())
            .map_err(|_| zip_err(format!("zip archive has {} records", entries.len())))?;
        let mut by_name: Vec<u32> = (0..n).collect();
        // Stable: among equal names, directory order; the repeat named is the earliest
        // second occurrence in the directory.
        by_name.sort_by(|&a, &b| entries[a as usize].name.cmp(&entries[b as usize].name));
        let repeat = by_name
            .windows(2)
            .filter(|w| entries[w[0] as usize].name == entries[w[1] as usize].name)
            .map(|w| w[1])
            .min();
        if let Some(i) = repeat {
            return Err(zip_err(format!(
                "zip record `{}` appears twice",
                short(&entries[i as usize].name)
            )));
        }
        Ok(Archive {
            prefix,
            entries,
            by_name,
            cd_offset: dir.offset,
        })
    }

    /// The entry called `name`.
    pub fn entry(&self, name: &str) -> Option<&Entry> {
        let i = self
            .by_name
            .binary_search_by(|&i| self.entries[i as usize].name.as_str().cmp(name))
            .ok()?;
        Some(&self.entries[self.by_name[i] as usize])
    }

    /// Locate the data of record `name`: checks its local header (signature, method, name)
    /// and that the data lies before the central directory.
    pub fn record(&self, bytes: &[u8], name: &str) -> Result<RecordSpan> {
        let e = self
            .entry(name)
            .ok_or_else(|| TorchZipError::MissingRecord(short(name)))?;
        let h = e.header_offset;
        if h.checked_add(LocalHeader::LEN)
            .is_none_or(|end| end > self.cd_offset)
        {
            return Err(zip_err(format!(
                "zip record `{}`: local header at {h} lies outside the archive",
                short(name)
            )));
        }
        let local = LocalHeader::parse(from(bytes, h)).ok_or_else(|| {
            zip_err(format!(
                "zip record `{}`: no local header signature at {h}",
                short(name)
            ))
        })?;
        if local.method != 0 {
            return Err(TorchZipError::Compressed {
                name: short(name),
                method: local.method,
            });
        }
        let name_len = local.name_len as u64;
        let local_name = bytes_at(bytes, h + LocalHeader::LEN, name_len).unwrap_or_default();
        if local_name != e.name.as_bytes() {
            return Err(zip_err(format!(
                "zip record `{}`: its local header names `{}`",
                short(name),
                short(&String::from_utf8_lossy(local_name))
            )));
        }
        let offset = h + LocalHeader::LEN + name_len + local.extra_len as u64;
        if offset
            .checked_add(e.size)
            .is_none_or(|end| end > self.cd_offset)
        {
            return Err(zip_err(format!(
                "zip record `{}` ({} bytes at {offset}) runs into the central directory",
                short(name),
                e.size
            )));
        }
        Ok(RecordSpan {
            offset,
            len: e.size,
        })
    }

    /// The data of record `name`.
    pub fn read<'a>(&self, bytes: &'a [u8], name: &str) -> Result<&'a [u8]> {
        let r = self.record(bytes, name)?;
        Ok(bytes_at(bytes, r.offset, r.len).unwrap_or_default())
    }

    /// Like [`Archive::read`], also checking the record's CRC-32 when the directory has one.
    pub fn read_checked<'a>(&self, bytes: &'a [u8], name: &str) -> Result<&'a [u8]> {
        let data = self.read(bytes, name)?;
        let want = self.entry(name).map_or(0, |e| e.crc);
        if want != 0 {
            let got = crc32fast::hash(data);
            if got != want {
                return Err(zip_err(format!(
                    "zip record `{}` fails its CRC-32 check ({got:08x}, expected {want:08x})",
                    short(name)
                )));
            }
        }
        Ok(data)
    }
}

// ---------------------------------------------------------------------------------------------
// Writing

/// Data alignment of every record, relative to the archive start (torch's
/// `.storage_alignment`).
pub const ALIGNMENT: u64 = 64;

/// Values at or above this do not fit a 32-bit zip field (torch/miniz use `>=`).
const U32_LIMIT: u64 = 0xFFFF_FFFF;
/// General-purpose flags: bit 3 (data descriptor) and bit 11 (UTF-8 names).
const FLAGS: u16 = 0x0808;
/// Flags of an empty record: UTF-8 names only, no data descriptor (as miniz writes them).
const FLAGS_EMPTY: u16 = 0x0800;
/// "Version needed to extract" for zip64 entries (4.5).
const ZIP64_VERSION: u16 = 45;

/// One record of an archive to write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Name without the archive prefix: `data.pkl`, `data/0`, `version`, `byteorder`,
    /// `.format_version`, `.storage_alignment`, `.data/serialization_id`.
    pub name: String,
    /// Data length in bytes.
    pub len: u64,
    /// The data, for literal records (`len` must equal its length); `None` for records whose
    /// data a caller writes at [`ArchiveLayout::data_offsets`] (tensor storages).
    pub content: Option<Vec<u8>>,
}

impl Record {
    /// A record with literal content.
    pub fn literal(name: impl Into<String>, content: impl Into<Vec<u8>>) -> Record {
        let content = content.into();
        Record {
            name: name.into(),
            len: content.len() as u64,
            content: Some(content),
        }
    }

    /// A record of `len` bytes whose data is written by the caller.
    pub fn data(name: impl Into<String>, len: u64) -> Record {
        Record {
            name: name.into(),
            len,
            content: None,
        }
    }
}

/// Where one record's pieces lie in the archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryLayout {
    /// Full record name (`<prefix>/<name>`).
    pub name: String,
    /// Data length.
    pub len: u64,
    /// Offset of the local header.
    pub header_offset: u64,
    /// Length of the local header's extra field (zip64 block + FB padding block).
    pub extra_len: u16,
    /// Offset of the first data byte (a multiple of [`ALIGNMENT`]).
    pub data_offset: u64,
    /// Offset of the data descriptor (right after the data). Empty records have none: torch
    /// (miniz) writes them with flags `0x0800` and no descriptor, so the next local header
    /// starts here.
    pub descriptor_offset: u64,
    /// Offset of the record's central-directory entry.
    pub central_offset: u64,
    /// The size does not fit 32 bits: zip64 sizes.
    pub zip64_size: bool,
    /// The local header offset does not fit 32 bits: zip64 offset.
    pub zip64_offset: bool,
}

impl EntryLayout {
    fn zip64(&self) -> bool {
        self.zip64_size || self.zip64_offset
    }

    /// "Version needed" (and "made by"): 4.5 for zip64 records, else 0 as torch writes.
    fn version(&self) -> u16 {
        if self.zip64() {
            ZIP64_VERSION
        } else {
            0
        }
    }

    /// Bytes of the data descriptor: none for an empty record (miniz writes empty records
    /// without the descriptor bit), 24 with zip64, else 16.
    fn descriptor_len(&self) -> u64 {
        if self.len == 0 {
            0
        } else {
            DataDescriptor::len(self.zip64())
        }
    }

    /// General-purpose flags: UTF-8 names, plus "data descriptor follows" unless empty.
    fn flags(&self) -> u16 {
        if self.len == 0 {
            FLAGS_EMPTY
        } else {
            FLAGS
        }
    }

    /// Length of the zip64 block in the central directory's extra field (0 when none).
    fn central_extra_len(&self) -> u64 {
        let n = 16 * self.zip64_size as u64 + 8 * self.zip64_offset as u64;
        if n == 0 {
            0
        } else {
            4 + n
        }
    }
}

/// The byte layout of an archive, computed from the records' names and lengths only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArchiveLayout {
    /// Total archive bytes.
    pub len: u64,
    /// Per record (indexed like the records), offset of its data relative to the archive
    /// start; always a multiple of [`ALIGNMENT`].
    pub data_offsets: Vec<u64>,
    /// The archive prefix (`archive`).
    pub prefix: String,
    /// Per record, where its headers lie.
    pub entries: Vec<EntryLayout>,
    /// Offset of the central directory.
    pub cd_offset: u64,
    /// Bytes of the central directory.
    pub cd_size: u64,
    /// Offset of the zip64 end-of-central-directory record (locator and classic EOCD follow).
    pub zip64_eocd_offset: u64,
}

/// Lay out an archive holding `records` (in that order) under `prefix`, the way torch's
/// writer does (module docs). Only names and lengths are used.
///
/// # Panics
/// If `prefix` is empty or contains `/`, if a literal record's `len` differs from its
/// content's length, or if a full record name exceeds 65535 bytes.
pub fn layout_archive(prefix: &str, records: &[Record]) -> ArchiveLayout {
    assert!(
        !prefix.is_empty() && !prefix.contains('/'),
        "archive prefix {prefix:?} must be a non-empty name without `/`"
    );
    let mut entries = Vec::with_capacity(records.len());
    let mut pos = 0u64;
    for r in records {
        if let Some(c) = &r.content {
            assert_eq!(
                c.len() as u64,
                r.len,
                "record `{}`: len differs from the content length",
                r.name
            );
        }
        let name = format!("{prefix}/{}", r.name);
        assert!(name.len() <= 0xFFFF, "record name too long: {}", name.len());
        let zip64_size = r.len >= U32_LIMIT;
        let zip64_offset = pos >= U32_LIMIT;
        let zip64_local = if zip64_size || zip64_offset {
            4 + 16 * zip64_size as u64 + 8 * zip64_offset as u64
        } else {
            0
        };
        // Data would start here with an FB block of 0 padding bytes.
        let start = pos + LocalHeader::LEN + name.len() as u64 + zip64_local + 4;
        let pad = (ALIGNMENT - start % ALIGNMENT) % ALIGNMENT;
        let data_offset = start + pad;
        let e = EntryLayout {
            name,
            len: r.len,
            header_offset: pos,
            extra_len: (zip64_local + 4 + pad) as u16,
            data_offset,
            descriptor_offset: data_offset + r.len,
            central_offset: 0,
            zip64_size,
            zip64_offset,
        };
        pos = e.descriptor_offset + e.descriptor_len();
        entries.push(e);
    }
    let cd_offset = pos;
    for e in &mut entries {
        e.central_offset = pos;
        pos += CentralHeader::LEN + e.name.len() as u64 + e.central_extra_len();
    }
    let cd_size = pos - cd_offset;
    let zip64_eocd_offset = pos;
    let len =
        pos + Zip64EndOfCentralDirectory::LEN + Zip64Locator::LEN + EndOfCentralDirectory::LEN;
    ArchiveLayout {
        len,
        data_offsets: entries.iter().map(|e| e.data_offset).collect(),
        prefix: prefix.to_string(),
        entries,
        cd_offset,
        cd_size,
        zip64_eocd_offset,
    }
}

/// A 32-bit zip field: the value, or `0xFFFFFFFF` when it lives in a zip64 extra.
fn field32(x: u64, zip64: bool) -> u32 {
    if zip64 {
        u32::MAX
    } else {
        x as u32
    }
}

/// The zip64 extra of a record (local header and central directory alike): usize/csize when
/// the size is large, then the local header offset when the offset is large, as torch writes.
fn zip64_extra(e: &EntryLayout) -> Zip64Extra {
    Zip64Extra {
        size: e.zip64_size.then_some(e.len),
        compressed_size: e.zip64_size.then_some(e.len),
        header_offset: e.zip64_offset.then_some(e.header_offset),
    }
}

/// The local header of a record, its name and its extra field (zip64 block when needed,
/// then the FB padding block that aligns the data).
fn local_header(w: &mut Vec<u8>, e: &EntryLayout) {
    LocalHeader {
        version_needed: e.version(),
        flags: e.flags(),
        name_len: e.name.len() as u16,
        extra_len: e.extra_len,
        ..LocalHeader::default()
    }
    .write(w);
    w.extend_from_slice(e.name.as_bytes());
    let mut extra_used = 0u64;
    if e.zip64() {
        let z = zip64_extra(e);
        z.write(w);
        extra_used = 4 + z.body_len() as u64;
    }
    let pad = e.extra_len as u64 - extra_used - 4;
    write_padding(w, pad as u16);
}

fn descriptor(w: &mut Vec<u8>, e: &EntryLayout, crc: u32) {
    DataDescriptor {
        crc32: crc,
        compressed_size: e.len,
        uncompressed_size: e.len,
        zip64: e.zip64(),
    }
    .write(w);
}

fn central_entry(w: &mut Vec<u8>, e: &EntryLayout, crc: u32) {
    CentralHeader {
        version_made_by: e.version(),
        version_needed: e.version(),
        flags: e.flags(),
        crc32: crc,
        compressed_size: field32(e.len, e.zip64_size),
        uncompressed_size: field32(e.len, e.zip64_size),
        name_len: e.name.len() as u16,
        extra_len: e.central_extra_len() as u16,
        header_offset: field32(e.header_offset, e.zip64_offset),
        ..CentralHeader::default()
    }
    .write(w);
    w.extend_from_slice(e.name.as_bytes());
    if e.central_extra_len() > 0 {
        zip64_extra(e).write(w);
    }
}

/// The zip64 end record, its locator and the classic end record.
fn end_records(w: &mut Vec<u8>, layout: &ArchiveLayout) {
    let count = layout.entries.len() as u64;
    Zip64EndOfCentralDirectory {
        record_size: Zip64EndOfCentralDirectory::LEN - 12,
        version_made_by: 0x031e, // as torch
        version_needed: ZIP64_VERSION,
        disk: 0,
        cd_disk: 0,
        entries_on_disk: count,
        entries: count,
        cd_size: layout.cd_size,
        cd_offset: layout.cd_offset,
    }
    .write(w);
    Zip64Locator {
        eocd_disk: 0,
        eocd_offset: layout.zip64_eocd_offset,
        disks: 1,
    }
    .write(w);
    let count16 = count.min(0xFFFF) as u16;
    EndOfCentralDirectory {
        entries_on_disk: count16,
        entries: count16,
        cd_size: field32(layout.cd_size, layout.cd_size >= U32_LIMIT),
        cd_offset: field32(layout.cd_offset, layout.cd_offset >= U32_LIMIT),
        ..EndOfCentralDirectory::default()
    }
    .write(w);
}

fn check_records(layout: &ArchiveLayout, records: &[Record]) {
    assert_eq!(
        layout.entries.len(),
        records.len(),
        "records differ from the layout's"
    );
    for (e, r) in layout.entries.iter().zip(records) {
        assert!(
            e.len == r.len && e.name.ends_with(&r.name),
            "record `{}` differs from the layout's `{}`",
            r.name,
            e.name
        );
    }
}

/// The CRC-32 of record `i` as written: computed for literal records, `crcs[i]` (0 when
/// missing) for data records.
fn record_crc(records: &[Record], crcs: &[u32], i: usize) -> u32 {
    match &records[i].content {
        Some(c) => crc32fast::hash(c),
        None => crcs.get(i).copied().unwrap_or(0),
    }
}

/// Every byte of the archive except the data of records with `content: None`, as
/// `(offset, bytes)` pieces relative to the archive start, sorted and non-adjacent (contiguous
/// pieces are merged). `crcs` holds the CRC-32 of the data records, indexed like `records`
/// (entries of literal records are ignored; missing entries count as 0). Never materializes
/// data records, whatever their size.
///
/// # Panics
/// If `records` are not the ones `layout` was computed from (count, names, lengths).
pub fn archive_bytes(
    layout: &ArchiveLayout,
    records: &[Record],
    crcs: &[u32],
) -> Vec<(u64, Vec<u8>)> {
    check_records(layout, records);
    let mut out: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut cur: Option<(u64, Vec<u8>)> = None;
    // Append bytes at `at` to the current piece (starting a new one after a gap).
    let mut emit = |at: u64, bytes: Vec<u8>, out: &mut Vec<(u64, Vec<u8>)>| match &mut cur {
        Some((start, buf)) if *start + buf.len() as u64 == at => buf.extend_from_slice(&bytes),
        _ => {
            if let Some(done) = cur.replace((at, bytes)) {
                out.push(done);
            }
        }
    };
    for (i, (e, r)) in layout.entries.iter().zip(records).enumerate() {
        let crc = record_crc(records, crcs, i);
        let mut head = Vec::with_capacity((e.data_offset - e.header_offset) as usize);
        local_header(&mut head, e);
        debug_assert_eq!(e.header_offset + head.len() as u64, e.data_offset);
        emit(e.header_offset, head, &mut out);
        if let Some(c) = &r.content {
            emit(e.data_offset, c.clone(), &mut out);
        }
        if e.descriptor_len() > 0 {
            let mut d = Vec::with_capacity(24);
            descriptor(&mut d, e, crc);
            emit(e.descriptor_offset, d, &mut out);
        }
    }
    let mut tail = Vec::with_capacity((layout.len - layout.cd_offset) as usize);
    for (i, e) in layout.entries.iter().enumerate() {
        debug_assert_eq!(layout.cd_offset + tail.len() as u64, e.central_offset);
        central_entry(&mut tail, e, record_crc(records, crcs, i));
    }
    end_records(&mut tail, layout);
    debug_assert_eq!(layout.cd_offset + tail.len() as u64, layout.len);
    emit(layout.cd_offset, tail, &mut out);
    if let Some(done) = cur.take() {
        out.push(done);
    }
    out
}

/// Offsets (relative to the archive start) of the 4-byte little-endian CRC-32 fields of record
/// `i`: in its data descriptor and in its central-directory entry (only the latter for an
/// empty record, which has no descriptor and whose CRC is 0).
pub fn crc_offsets(layout: &ArchiveLayout, i: usize) -> Vec<u64> {
    let e = &layout.entries[i];
    let mut at = Vec::with_capacity(2);
    if e.descriptor_len() > 0 {
        at.push(e.descriptor_offset + DataDescriptor::CRC_OFFSET);
    }
    at.push(e.central_offset + CentralHeader::CRC_OFFSET);
    at
}

/// The executor's view of an archive placed at byte `base` of an output file
/// ([`reshard_core::output::OutputFile`]): its literal bytes (with CRC 0 for the data records), and one
/// [`reshard_core::output::Checksum`] per non-empty data record, which the executor computes over the
/// finished data and writes at the record's [`crc_offsets`]. The caller adds copy ops that
/// fill each data record `i` at `base + layout.data_offsets[i]`.
pub fn output_parts(
    layout: &ArchiveLayout,
    records: &[Record],
    base: u64,
) -> (
    Vec<(u64, reshard_core::output::Literal)>,
    Vec<reshard_core::output::Checksum>,
) {
    let literals = archive_bytes(layout, records, &[])
        .into_iter()
        .map(|(at, bytes)| (base + at, bytes.into()))
        .collect();
    let checksums = records
        .iter()
        .enumerate()
        .filter(|(_, r)| r.content.is_none() && r.len > 0)
        .map(|(i, r)| reshard_core::output::Checksum {
            range: (
                base + layout.data_offsets[i],
                base + layout.data_offsets[i] + r.len,
            ),
            at: crc_offsets(layout, i)
                .into_iter()
                .map(|o| base + o)
                .collect(),
            hex: false,
        })
        .collect();
    (literals, checksums)
}

/// For an archive written at byte `base` of `file` with CRC 0 for its data records: read each
/// data record back, compute its CRC-32 and patch it in at [`crc_offsets`]. Returns the CRCs
/// of all records (literal ones computed from their content).
#[cfg(any(test, feature = "internals"))]
pub fn fill_crcs(
    file: &std::fs::File,
    base: u64,
    layout: &ArchiveLayout,
    records: &[Record],
) -> std::io::Result<Vec<u32>> {
    use std::os::unix::fs::FileExt;
    check_records(layout, records);
    let mut buf = vec![0u8; 1 << 20];
    let mut crcs = Vec::with_capacity(records.len());
    for (i, (e, r)) in layout.entries.iter().zip(records).enumerate() {
        let crc = match &r.content {
            Some(c) => crc32fast::hash(c),
            None => {
                let mut h = crc32fast::Hasher::new();
                let mut done = 0u64;
                while done < e.len {
                    let n = (e.len - done).min(buf.len() as u64) as usize;
                    file.read_exact_at(&mut buf[..n], base + e.data_offset + done)?;
                    h.update(&buf[..n]);
                    done += n as u64;
                }
                let crc = h.finalize();
                for at in crc_offsets(layout, i) {
                    file.write_all_at(&crc.to_le_bytes(), base + at)?;
                }
                crc
            }
        };
        crcs.push(crc);
    }
    Ok(crcs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_parse_what_they_write() {
        let mut w = vec![];
        let local = LocalHeader {
            version_needed: 45,
            flags: 0x0808,
            method: 0,
            crc32: 7,
            name_len: 3,
            extra_len: 60,
            ..LocalHeader::default()
        };
        local.write(&mut w);
        assert_eq!(w.len() as u64, LocalHeader::LEN);
        assert_eq!(LocalHeader::parse(&w), Some(local));
        assert_eq!(LocalHeader::parse(&w[..29]), None);
        w.clear();
        let central = CentralHeader {
            crc32: 9,
            compressed_size: u32::MAX,
            uncompressed_size: u32::MAX,
            header_offset: 12,
            comment_len: 2,
            ..CentralHeader::default()
        };
        central.write(&mut w);
        assert_eq!(w.len() as u64, CentralHeader::LEN);
        assert_eq!(
            &w[CentralHeader::CRC_OFFSET as usize..][..4],
            &9u32.to_le_bytes()
        );
        assert_eq!(CentralHeader::parse(&w), Some(central));
        for zip64 in [false, true] {
            w.clear();
            let d = DataDescriptor {
                crc32: 1,
                compressed_size: 5,
                uncompressed_size: 5,
                zip64,
            };
            d.write(&mut w);
            assert_eq!(w.len() as u64, DataDescriptor::len(zip64));
            assert_eq!(DataDescriptor::parse(&w, zip64), Some(d));
        }
        w.clear();
        let z = Zip64EndOfCentralDirectory {
            record_size: 44,
            entries: 3,
            cd_offset: 1 << 33,
            ..Zip64EndOfCentralDirectory::default()
        };
        z.write(&mut w);
        assert_eq!(w.len() as u64, Zip64EndOfCentralDirectory::LEN);
        assert_eq!(Zip64EndOfCentralDirectory::parse(&w), Some(z));
        w.clear();
        let l = Zip64Locator {
            eocd_disk: 0,
            eocd_offset: 99,
            disks: 1,
        };
        l.write(&mut w);
        assert_eq!(Zip64Locator::parse(&w), Some(l));
        w.clear();
        let e = EndOfCentralDirectory {
            entries: 0xFFFF,
            ..EndOfCentralDirectory::default()
        };
        e.write(&mut w);
        assert_eq!(EndOfCentralDirectory::parse(&w), Some(e.clone()));
        assert!(e.needs_zip64());
        w[0] ^= 1;
        assert_eq!(EndOfCentralDirectory::parse(&w), None);
    }

    #[test]
    fn zip64_extra_blocks() {
        let mut w = vec![];
        write_padding(&mut w, 3);
        let z = Zip64Extra {
            size: Some(1 << 32),
            compressed_size: Some(1 << 32),
            header_offset: None,
        };
        z.write(&mut w);
        assert_eq!(&w[..7], b"FB\x03\x00ZZZ");
        let body = Zip64Extra::find(&w).unwrap();
        assert_eq!(body.len(), 16);
        assert_eq!(Zip64Extra::parse(body, true, true, false), Ok(z));
        assert_eq!(
            Zip64Extra::parse(body, true, true, true),
            Err("local header offset")
        );
        assert_eq!(Zip64Extra::find(&w[..10]), None);
    }

    /// A whole archive of literal records.
    fn archive_of(records: &[Record]) -> Vec<u8> {
        let l = layout_archive("archive", records);
        let mut out = vec![0u8; l.len as usize];
        for (at, bytes) in archive_bytes(&l, records, &[]) {
            out[at as usize..at as usize + bytes.len()].copy_from_slice(&bytes);
        }
        out
    }

    #[test]
    fn records_are_found_by_name_and_a_repeated_name_is_refused() {
        let names = [
            "version",
            "data.pkl",
            "data/1",
            "byteorder",
            "data/0",
            ".format_version",
        ];
        let records: Vec<Record> = names
            .iter()
            .map(|n| Record::literal(*n, n.as_bytes().to_vec()))
            .collect();
        let bytes = archive_of(&records);
        let a = Archive::parse(&bytes).unwrap();
        for n in names {
            let name = format!("archive/{n}");
            assert_eq!(a.read(&bytes, &name).unwrap(), n.as_bytes(), "{name}");
        }
        assert!(a.entry("archive/data/2").is_none());
        assert!(a.entry("archive").is_none());
        // Two names repeated: the message names the one repeated first in the directory.
        let twice = ["data.pkl", "data/1", "version", "data/1", "data.pkl"];
        let records: Vec<Record> = twice.iter().map(|n| Record::literal(*n, vec![1])).collect();
        let e = Archive::parse(&archive_of(&records))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("zip record `archive/data/1` appears twice"),
            "{e}"
        );
    }

    #[test]
    fn layout_matches_torch_offsets() {
        // §3.2: fsdp2_w4_f32 item model.cls chunk 0, 1577 bytes.
        let records = vec![
            Record::literal("data.pkl", vec![0; 154]),
            Record::literal(".format_version", b"1".to_vec()),
            Record::literal(".storage_alignment", b"64".to_vec()),
            Record::literal("byteorder", b"little".to_vec()),
            Record::data("data/0", 48),
            Record::literal("version", b"3\n".to_vec()),
            Record::literal(".data/serialization_id", vec![b'1'; 40]),
        ];
        let l = layout_archive("archive", &records);
        let headers: Vec<u64> = l.entries.iter().map(|e| e.header_offset).collect();
        assert_eq!(headers, [0, 234, 337, 466, 598, 768, 850]);
        assert_eq!(l.data_offsets, [64, 320, 448, 576, 704, 832, 960]);
        assert_eq!(l.len, 1577);
        assert_eq!(l.cd_offset, 0x3f8);
        assert_eq!(l.cd_size, 0x1cf);
    }
}
