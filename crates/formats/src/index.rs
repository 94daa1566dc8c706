//! Which bytes opening a checkpoint reads — for a checkpoint read from object storage
//! through a mirror of sparse files (`crate::remote`), whose bytes must be fetched before a
//! reader looks at them. Each format says it of its own files ([`crate::Codec::index`]),
//! composing the pieces here; tensor data is not here: the executor and the loader fetch it
//! as they copy, from the plan.
//!
//! The pieces: small files whole ([`small_whole_else`]); a `.safetensors` file's header
//! ([`safetensors_header`]); a `torch.save` archive's end records, central directory, local
//! headers and every record that is not a large storage ([`zip_index`]); a DCP folder's
//! metadata and each item's records around its tensor data ([`dcp`]).

use super::torch::zip;
use crate::error::Result;
use std::path::{Path, PathBuf};

/// Fetches the given byte ranges (first byte, past the last) of a mirrored file.
pub type Fetch<'a> = &'a dyn Fn(&Path, &[(u64, u64)]) -> Result<()>;

/// Files up to this size are fetched whole.
const SMALL: u64 = 1 << 20;
/// A `torch.save` storage record up to this size is fetched with the archive's index
/// (small tensors a reader may read as values, such as an optimizer's `step`).
const SMALL_RECORD: u64 = 64 << 10;
/// The tail of an archive fetched to find its end records: the classic record with the
/// longest comment, and the zip64 record and locator.
const ZIP_TAIL: u64 = 22 + 0xFFFF + 56 + 20;
/// What a local header can take: its fixed part, and a name and extra fields of at most
/// this many bytes beyond the name in the central directory.
const LOCAL_EXTRA: u64 = 30 + 256;

/// Fetch the files of `files` of at most 1 MiB whole (metadata, JSON, `latest`, small
/// pickles), and what `large` says of each larger one.
pub fn small_whole_else(
    files: &[(PathBuf, u64)],
    fetch: Fetch,
    large: fn(&Path, u64, Fetch) -> Result<()>,
) -> Result<()> {
    for (path, size) in files {
        if *size > SMALL {
            large(path, *size, fetch)?;
        } else {
            fetch(path, &[(0, *size)])?;
        }
    }
    Ok(())
}

/// Nothing fetched now: for [`small_whole_else`], large files a later step fetches.
pub fn later(_path: &Path, _size: u64, _fetch: Fetch) -> Result<()> {
    Ok(())
}

/// What opening a DCP checkpoint (or one around it: megatron-core's) reads of `files`: the
/// metadata whole, `.distcp` files not at all at first, other files whole when small and
/// as `torch.save` archives ([`zip_index`]) when large; then, per folder holding a
/// `.metadata`, each item's records around its tensor data as the metadata places them.
pub fn dcp(files: &[(PathBuf, u64)], fetch: Fetch) -> Result<()> {
    let mut dirs: Vec<PathBuf> = vec![];
    for (path, size) in files {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let metadata =
            name == ".metadata" || (name.starts_with("__") && name.ends_with(".metadata"));
        if metadata {
            if let Some(d) = path.parent() {
                if !dirs.iter().any(|x| x == d) {
                    dirs.push(d.to_path_buf());
                }
            }
        }
        if name.ends_with(".distcp") {
            continue;
        }
        if metadata || *size <= SMALL {
            fetch(path, &[(0, *size)])?;
        } else {
            zip_index(path, *size, fetch)?;
        }
    }
    for dir in dirs {
        // A folder whose metadata does not parse is left to the reader to report.
        if let Ok(spans) = super::dcp::index_ranges(&dir) {
            for (path, spans) in spans {
                fetch(&path, &spans)?;
            }
        }
    }
    Ok(())
}

/// A `.safetensors` file's length prefix and header.
pub fn safetensors_header(path: &Path, size: u64, fetch: Fetch) -> Result<()> {
    fetch(path, &[(0, 8.min(size))])?;
    let mut len = [0u8; 8];
    if read_at(path, &mut len, 0).is_err() {
        return Ok(());
    }
    let n = u64::from_le_bytes(len);
    // A length the file cannot hold is the reader's to report.
    if n <= size - 8 {
        fetch(path, &[(8, 8 + n)])?;
    }
    Ok(())
}

/// A `torch.save` archive's end records, central directory, local headers, and the records
/// that are not large storages. An archive that does not parse is fetched whole, for the
/// reader to report on.
pub fn zip_index(path: &Path, size: u64, fetch: Fetch) -> Result<()> {
    fetch(path, &[(size.saturating_sub(ZIP_TAIL), size)])?;
    let map = crate::sys::map_readonly(path, memmap2::Advice::Random)?;
    let Ok((offset, len)) = zip::directory_span(&map) else {
        return fetch(path, &[(0, size)]);
    };
    fetch(path, &[(offset, offset.saturating_add(len))])?;
    let Ok(archive) = zip::Archive::parse(&map) else {
        return fetch(path, &[(0, size)]);
    };
    let headers: Vec<(u64, u64)> = archive
        .entries
        .iter()
        .map(|e| {
            let end = e
                .header_offset
                .saturating_add(LOCAL_EXTRA + e.name.len() as u64)
                .min(offset);
            (e.header_offset.min(end), end)
        })
        .collect();
    fetch(path, &headers)?;
    let storage = format!("{}/data/", archive.prefix);
    let records: Vec<(u64, u64)> = archive
        .entries
        .iter()
        .filter(|e| !e.name.starts_with(&storage) || e.size <= SMALL_RECORD)
        .filter_map(|e| archive.record(&map, &e.name).ok())
        .map(|r| (r.offset, r.offset.saturating_add(r.len)))
        .collect();
    fetch(path, &records)
}

fn read_at(path: &Path, buf: &mut [u8], at: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    std::fs::File::open(path)?.read_exact_at(buf, at)
}
