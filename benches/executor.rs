//! Executor benchmarks: bytes per second that [`reshard::exec::execute`] moves from sharded
//! sources into one destination file, page cache warm, without fsync.
//!
//! Every case gathers a 256 MiB float32 model (16 tensors of 4096 × 1024) from 4 per-rank
//! safetensors shards (torch's HF storage layout, written by reshard itself) into one
//! `.safetensors` file:
//! - `Shard(0)`: each rank holds whole rows, so every copy is one contiguous run (the path
//!   that hands runs to `copy_file_range`);
//! - `Shard(1)`: each rank holds a 1 KiB column block of every row, so the destination is
//!   assembled row by row in the window buffer (strided copies, then `pwrite`);
//! - 2-D mesh `[2, 2]` with `[Shard(0), Shard(1)]`: half the rows, 2 KiB column blocks.
//!
//! The plan is prepared once ([`reshard::convert::prepare`], as the CLI does). Two benches
//! per case, both without fsync (its cost is the disk's, not reshard's):
//! - `execute …`: truncate the destination, run [`reshard::exec::execute`] (default threads
//!   and window) — the executor alone, hashing every output tensor for the header's CRC-32s;
//! - `run …`: [`reshard::convert::run`] with the CLI's defaults but `--no-fsync`: the checks of
//!   the sources' recorded CRC-32s, staging, the executor, the atomic `--force` replace.
//!
//! Files live in a temporary directory, about 1 GiB at the peak.
//!
//! `cargo bench --bench executor` (about a minute plus setup).

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use reshard::convert::{convert, prepare, run, ConvertOptions};
use reshard::formats::Format;
use reshard::target::LayoutSpec;
use safetensors::tensor::Dtype;
use std::path::Path;
use std::time::Duration;

mod common;

/// Tensors in the model.
const TENSORS: usize = 16;
/// Shape of every tensor (float32, 16 MiB each).
const SHAPE: [usize; 2] = [4096, 1024];

/// Write the full model as one safetensors file (finite values, distinct per tensor).
fn write_model(path: &Path) {
    let n = SHAPE[0] * SHAPE[1];
    let data: Vec<Vec<u8>> = (0..TENSORS)
        .map(|t| {
            (0..n)
                .flat_map(|i| ((i % 65_521) as f32 * 0.25 + t as f32).to_le_bytes())
                .collect()
        })
        .collect();
    let tensors: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    common::write_safetensors(path, "", Dtype::F32, &SHAPE, &tensors);
}

/// Options that write without fsync and skip source CRC checks (the bench measures copying).
fn options(layout: LayoutSpec, format: Format) -> ConvertOptions {
    let mut o = ConvertOptions::to(1);
    o.layout = layout;
    o.format = Some(format);
    o.exec.sync = false;
    o.verify = false;
    o.force = true;
    o
}

/// Reshard `model` into `dir` as 4 per-rank shards laid out by `layout` (JSON layout file).
fn shard(model: &Path, dir: &Path, layout: &str) {
    let spec = LayoutSpec::from_json(layout.as_bytes()).unwrap();
    convert(model, dir, &options(spec, Format::HF_STORAGE)).unwrap();
}

/// Panic unless `out` holds the same tensors, byte for byte, as `model`.
fn check_same_tensors(model: &Path, out: &Path) {
    let (a, b) = (std::fs::read(model).unwrap(), std::fs::read(out).unwrap());
    let (a, b) = (
        safetensors::SafeTensors::deserialize(&a).unwrap(),
        safetensors::SafeTensors::deserialize(&b).unwrap(),
    );
    assert_eq!(a.len(), b.len());
    for (name, t) in a.tensors() {
        assert_eq!(t.data(), b.tensor(&name).unwrap().data(), "{name}");
    }
}

fn bench(c: &mut Criterion) {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model.safetensors");
    write_model(&model);
    let cases = [
        (
            "Shard(0) 4 ranks -> 1 (contiguous runs)",
            r#"{"mesh": [4]}"#,
        ),
        (
            "Shard(1) 4 ranks -> 1 (1 KiB rows)",
            r#"{"mesh": [4], "rules": [{"match": "*", "placements": ["Shard(1)"]}]}"#,
        ),
        (
            "[Shard(0), Shard(1)] 2x2 mesh -> 1 (2 KiB rows)",
            r#"{"mesh": [2, 2], "rules": [{"match": "*", "placements": ["Shard(0)", "Shard(1)"]}]}"#,
        ),
    ];
    let mut g = c.benchmark_group("executor");
    g.sample_size(10);
    g.sampling_mode(SamplingMode::Flat);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(5));
    for (name, layout) in cases {
        let src = tmp.path().join("src");
        shard(&model, &src, layout);
        let dst = tmp.path().join("out.safetensors");
        let opts = options(LayoutSpec::fsdp(1), Format::SAFETENSORS);
        let job = prepare(&src, Some(&dst), &opts).unwrap();
        g.throughput(Throughput::Bytes(job.plan.bytes_written()));
        g.bench_function(format!("execute {name}"), |b| {
            b.iter(|| common::execute_into(&job, &dst, &opts.exec))
        });
        check_same_tensors(&model, &dst);
        std::fs::remove_file(&dst).unwrap();
        // The CLI's path after planning: source CRC checks, staging, execute, commit.
        let cli = ConvertOptions {
            verify: true,
            ..opts.clone()
        };
        g.bench_function(format!("run {name}"), |b| {
            b.iter(|| run(&job, &dst, &cli).unwrap())
        });
        check_same_tensors(&model, &dst);
        std::fs::remove_dir_all(&src).unwrap();
        std::fs::remove_file(&dst).unwrap();
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
