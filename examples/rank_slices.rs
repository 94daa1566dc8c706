//! The slices rank `r` of `M` would load: for every tensor, the region FSDP2's `Shard(0)` over
//! M ranks gives rank r and which source files and bytes hold it; then the data itself, read
//! with the trainer-side loader (`reshard::load::local_shards`) straight from the files,
//! touching only what the rank needs — no process group.
//!
//! ```text
//! cargo run --release --example rank_slices -- examples/data/hf_storage_w4 3 1
//! ```

use reshard::formats::Checkpoint;
use reshard::plan::{region_ops, CopyOp};
use reshard::target::LayoutSpec;
use std::path::PathBuf;

/// `FILE@OFFSET+LENxROWS` for each op, comma-separated: the source bytes the ops read.
fn describe(ck: &Checkpoint, ops: &[CopyOp]) -> String {
    let name = |src: u32| {
        ck.files[src as usize]
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
    };
    ops.iter()
        .map(|o| format!("{}@{}+{}x{}", name(o.src), o.src_offset, o.len, o.count))
        .collect::<Vec<_>>()
        .join(", ")
}

fn main() -> reshard::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(path), Some(m), Some(r)) = (
        args.first(),
        args.get(1).and_then(|m| m.parse::<u64>().ok()),
        args.get(2).and_then(|r| r.parse::<u64>().ok()),
    ) else {
        eprintln!("usage: rank_slices CHECKPOINT M RANK");
        std::process::exit(2);
    };
    if m == 0 || r >= m {
        eprintln!("RANK must be below M, and M at least 1");
        std::process::exit(2);
    }
    let ck = Checkpoint::open(PathBuf::from(path))?;
    let wanted: Vec<_> = ck
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.dtype, t.shape.clone()))
        .collect();
    let target = LayoutSpec::fsdp(m).compile(&wanted)?;
    let mut total = 0u64;
    println!(
        "rank {r} of {m} loads from {} ({} ranks):",
        ck.path.display(),
        ck.ranks
    );
    for (t, tt) in ck.tensors.iter().zip(&target) {
        for region in tt.ranks[r as usize].iter().filter(|g| !g.is_empty()) {
            // Which bytes of which files hold this region.
            let ops = region_ops(t, region, t.dtype);
            let data_len = region.volume() * t.dtype.size() as u64;
            total += data_len;
            println!(
                "  {:32} {:5} {} <- {}",
                t.name,
                t.dtype.name(),
                region,
                describe(&ck, &ops)
            );
        }
    }
    // The trainer-side loader does the same and returns the bytes, touching only these ranges.
    let shards =
        reshard::load::local_shards(&ck, &LayoutSpec::fsdp(m), r, &Default::default(), None)?;
    let loaded: u64 = shards.iter().map(|s| s.data.len() as u64).sum();
    assert_eq!(loaded, total);
    println!("{loaded} bytes loaded for rank {r} by reshard::load::local_shards");
    Ok(())
}
