//! Consolidate a sharded checkpoint into one `.safetensors` file with the library.
//!
//! ```text
//! cargo run --release --example consolidate -- examples/data/hf_storage_w4 /tmp/model.safetensors
//! ```

use reshard::convert::{convert, ConvertOptions};
use std::path::PathBuf;

fn main() {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let [src, dst] = args.as_slice() else {
        eprintln!("usage: consolidate SRC DST.safetensors");
        std::process::exit(2);
    };
    // M = 1 with FSDP2's default Shard(0) placement: one rank holding every tensor whole.
    let opts = ConvertOptions::to(1);
    match convert(src, dst, &opts) {
        Ok((job, stats)) => println!(
            "{} tensors from {} rank(s) of {} -> {} ({} bytes written)",
            job.plan.tensors.len(),
            job.source.ranks,
            src.display(),
            dst.display(),
            stats.bytes_written
        ),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
