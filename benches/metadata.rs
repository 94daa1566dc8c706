//! DCP metadata benchmarks: bytes of `.metadata` per second, parsed and opened.
//!
//! Each case builds a real DCP checkpoint with reshard itself: a float32 model of `n`
//! tensors of 64 × 16 written as DCP over 16 ranks with `Shard(0)` (4 rows per chunk), so the
//! `.metadata` pickle names `16 n` chunks with their `MetadataIndex` / `_StorageInfo`
//! entries in torch 2.1's class layout. Two groups, both with throughput in `.metadata` bytes:
//! - `pickle::parse`: the raw pickle reader ([`reshard::formats::pickle::parse`] with the
//!   DCP allow-list) over the file's bytes in memory;
//! - `Checkpoint::open`: opening the whole checkpoint ([`reshard::formats::Checkpoint::open`]):
//!   reading and interpreting `.metadata`, then locating and checking every chunk's
//!   torch.save item in the mapped `.distcp` files (page cache warm).
//!
//! reshard's `.metadata` memoises class names and strings as torch's does, but the two
//! writers' pickles still differ in size per chunk, so both groups also run on the
//! torch-written fixture `tests/fixtures/fsdp2_w4_f32` (torch 2.15, FSDP2 over 4 ranks), and
//! time per chunk compares better across writers than bytes/s.
//!
//! A third group, `pickle::parse_graph`, times the value-graph decoding the DCP reader uses
//! (throughput in chunks). `RESHARD_BENCH_DCP=DIR` adds a checkpoint made by
//! `scripts/gen_scale_dcp.py` (torch's own `Metadata` and items) to every group.
//!
//! `cargo bench --bench metadata` (about a minute plus setup).

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use reshard::convert::{convert, ConvertOptions};
use reshard::formats::torch::pickle::{dcp_metadata_globals, parse, parse_graph};
use reshard::formats::{Checkpoint, Format};
use safetensors::tensor::Dtype;
use std::hint::black_box;
use std::path::Path;
use std::time::Duration;

mod common;

/// Target ranks of the generated checkpoints.
const WORLD: u64 = 16;

/// Write a DCP checkpoint of `n` float32 tensors of 64 × 16 over [`WORLD`] ranks to `dir`.
fn write_dcp(tmp: &Path, dir: &Path, n: usize) {
    let data: Vec<Vec<u8>> = (0..n)
        .map(|t| {
            (0..64 * 16)
                .flat_map(|i| (i as f32 + t as f32).to_le_bytes())
                .collect()
        })
        .collect();
    let tensors: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let model = tmp.join("model.safetensors");
    common::write_safetensors(&model, "model.", Dtype::F32, &[64, 16], &tensors);
    let mut opts = ConvertOptions::to(WORLD);
    opts.format = Some(Format::DCP);
    opts.exec.sync = false;
    convert(&model, dir, &opts).unwrap();
    std::fs::remove_file(&model).unwrap();
}

fn bench(c: &mut Criterion) {
    let tmp = tempfile::tempdir().unwrap();
    let sizes = [1_000usize, 4_000];
    let mut cases = vec![];
    for n in sizes {
        let dir = tmp.path().join(format!("dcp{n}"));
        write_dcp(tmp.path(), &dir, n);
        let ck = Checkpoint::open(&dir).unwrap();
        assert_eq!(ck.tensors.len(), n);
        let pieces: usize = ck.tensors.iter().map(|t| t.pieces.len()).sum();
        assert_eq!(pieces as u64, n as u64 * WORLD);
        let meta = std::fs::read(dir.join(".metadata")).unwrap();
        let chunks = n as u64 * WORLD;
        eprintln!(
            "{n} tensors, {chunks} chunks: .metadata is {} bytes",
            meta.len()
        );
        cases.push((
            format!("{n} tensors x {WORLD} ranks ({chunks} chunks)"),
            dir,
            meta,
        ));
    }
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fsdp2_w4_f32/checkpoint");
    if fixture.join(".metadata").is_file() {
        let ck = Checkpoint::open(&fixture).unwrap();
        let chunks: usize = ck.tensors.iter().map(|t| t.pieces.len()).sum();
        let meta = std::fs::read(fixture.join(".metadata")).unwrap();
        let name = format!("torch fixture fsdp2_w4_f32 ({chunks} chunks)");
        cases.push((name, fixture, meta));
    }
    // A checkpoint made by `scripts/gen_scale_dcp.py` (torch's own Metadata pickle and
    // items), when given: `RESHARD_BENCH_DCP=DIR cargo bench --bench metadata`.
    if let Some(dir) = std::env::var_os("RESHARD_BENCH_DCP").map(std::path::PathBuf::from) {
        let ck = Checkpoint::open(&dir).unwrap();
        let chunks: usize = ck.tensors.iter().map(|t| t.pieces.len()).sum();
        let meta = std::fs::read(dir.join(".metadata")).unwrap();
        cases.push((format!("{} ({chunks} chunks)", dir.display()), dir, meta));
    }
    let globals = dcp_metadata_globals();
    // The value graph the DCP reader decodes `.metadata` from, per chunk.
    let mut g = c.benchmark_group("pickle::parse_graph");
    g.sample_size(10);
    g.sampling_mode(SamplingMode::Flat);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(3));
    for (name, dir, meta) in &cases {
        let ck = Checkpoint::open(dir).unwrap();
        let chunks: usize = ck.tensors.iter().map(|t| t.pieces.len()).sum();
        g.throughput(Throughput::Elements(chunks as u64));
        g.bench_function(name, |b| {
            b.iter(|| parse_graph(black_box(meta), &globals).unwrap())
        });
    }
    g.finish();
    let mut g = c.benchmark_group("pickle::parse");
    g.sample_size(20);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(3));
    for (name, _, meta) in &cases {
        g.throughput(Throughput::Bytes(meta.len() as u64));
        g.bench_function(name, |b| {
            b.iter(|| parse(black_box(meta), &globals).unwrap())
        });
    }
    g.finish();
    let mut g = c.benchmark_group("Checkpoint::open");
    g.sample_size(10);
    g.sampling_mode(SamplingMode::Flat);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(3));
    for (name, dir, meta) in &cases {
        g.throughput(Throughput::Bytes(meta.len() as u64));
        g.bench_function(name, |b| {
            b.iter(|| Checkpoint::open(black_box(dir)).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
