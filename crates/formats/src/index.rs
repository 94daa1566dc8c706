//! Which bytes opening a checkpoint reads — for a checkpoint read from object storage
//! through a mirror of sparse files (`crate::remote`), whose bytes must be fetched before a
//! reader looks at them. Tensor data is not here: the executor and the loader fetch it as
//! they copy, from the plan.
//!
//! By file: small files and files that are not tensor data (`.metadata`, JSON, `latest`,
//! pickles) are fetched whole; a `.safetensors` file, its header; a `torch.save` archive
//! (`.pt`, `.bin`, `.pth`, `.ckpt`), its end records, central directory, local headers and
//! every record that is not a large storage; a `.distcp` file, each item's records around
//! its tensor data, as the DCP metadata places them.

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

/// Fetch what opening the checkpoint made of `files` (local paths and sizes) reads.
pub fn prefetch(files: &[(PathBuf, u64)], fetch: Fetch) -> Result<()> {
    let mut dcp_dirs: Vec<PathBuf> = vec![];
    for (path, size) in files {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let ext = name.rsplit_once('.').map(|(_, e)| e).unwrap_or("");
        if name == ".metadata" || (name.starts_with("__") && name.ends_with(".metadata")) {
            if let Some(d) = path.parent() {
                if !dcp_dirs.iter().any(|x| x == d) {
                    dcp_dirs.push(d.to_path_buf());
                }
            }
        }
        match ext {
            "distcp" => {}
            "safetensors" if *size > SMALL => safetensors_header(path, *size, fetch)?,
            "pt" | "bin" | "pth" | "ckpt" if *size > SMALL => zip_index(path, *size, fetch)?,
            _ => fetch(path, &[(0, *size)])?,
        }
    }
    for dir in dcp_dirs {
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
fn safetensors_header(path: &Path, size: u64, fetch: Fetch) -> Result<()> {
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
fn zip_index(path: &Path, size: u64, fetch: Fetch) -> Result<()> {
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
