//! What the benchmarks share: writing a model as one safetensors file, and running a
//! prepared job's plan into a fresh destination. Included by each bench with `mod common;`.

#![allow(dead_code)] // each bench uses only some of these

use reshard::convert::Job;
use reshard::exec::{execute, ExecOptions, ExecStats};
use safetensors::tensor::{Dtype, TensorView};
use std::path::{Path, PathBuf};

/// Write tensors `layers.{i}.weight` (prefixed by `prefix`), each of `shape` and `dtype`,
/// with the bytes of `data[i]`, as one safetensors file.
pub fn write_safetensors(path: &Path, prefix: &str, dtype: Dtype, shape: &[usize], data: &[&[u8]]) {
    let views: Vec<(String, TensorView)> = data
        .iter()
        .enumerate()
        .map(|(t, d)| {
            let v = TensorView::new(dtype, shape.to_vec(), d).unwrap();
            (format!("{prefix}layers.{t}.weight"), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// Run `job`'s plan into a fresh (truncated) file `dst`, as a real run writes one.
pub fn execute_into(job: &Job, dst: &Path, opts: &ExecOptions) -> ExecStats {
    std::fs::File::create(dst).unwrap();
    let dests: Vec<PathBuf> = vec![dst.to_path_buf()];
    execute(
        &job.plan,
        job.source.sources(),
        &job.output.files,
        &dests,
        opts,
    )
    .unwrap()
}
