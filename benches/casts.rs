//! Dtype-cast benchmarks: elements per second through the executor's cast code.
//!
//! The cast kernels themselves are private to the library (`layout::cast`); the public path that runs it with
//! the least around it is [`reshard::exec::read_into`]: one [`CopyOp`] with a [`Cast`] over a
//! 2^24-element source file (page cache warm, mapped) into a buffer in memory. Group `cast`
//! measures bf16 → f32, f16 → f32, f32 → bf16 and f32 → f16 that way, next to the same copy
//! without a cast (`copy f32`, `copy bf16`) so the cast's own cost is the difference.
//!
//! Group `convert --dtype` measures the end-to-end executor path with a cast: a 64 MiB
//! float32 `.safetensors` file (16 tensors of 1024 × 1024) written as bf16 and the bf16 file
//! written back as f32, with [`reshard::exec::execute`] (default threads, no fsync) on a
//! plan from [`reshard::convert::prepare`] — what `reshard convert --dtype` runs.
//!
//! `cargo bench --bench casts` (under a minute).

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use half::{bf16, f16};
use reshard::convert::{prepare, ConvertOptions};
use reshard::exec::{read_into, ExecOptions, Sources};
use reshard::formats::Format;
use reshard::layout::DType;
use reshard::plan::{Cast, CopyOp};
use safetensors::tensor::Dtype;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Duration;

mod common;

/// Elements per cast in group `cast`.
const N: usize = 1 << 24;

/// `i`-th test value: finite, normal in every dtype here, varied mantissas.
fn value(i: usize) -> f32 {
    ((i % 4093) as f32 - 2046.0) * 0.0137
}

/// `N` values encoded as `dtype`, little-endian.
fn encoded(dtype: DType) -> Vec<u8> {
    (0..N)
        .flat_map(|i| {
            let x = value(i);
            match dtype {
                DType::F32 => x.to_le_bytes().to_vec(),
                DType::BF16 => bf16::from_f32(x).to_le_bytes().to_vec(),
                DType::F16 => f16::from_f32(x).to_le_bytes().to_vec(),
                _ => unreachable!(),
            }
        })
        .collect()
}

/// One op reading all of source 0 into the start of the buffer, cast from `from` to `to`.
fn whole(from: DType, to: DType) -> CopyOp {
    CopyOp {
        src: 0,
        src_offset: 0,
        dst: 0,
        dst_offset: 0,
        len: (N * from.size()) as u64,
        count: 1,
        src_stride: 0,
        dst_stride: 0,
        cast: (from != to).then_some(Cast {
            from,
            to,
            scale: None,
        }),
    }
}

fn bench_read_into(c: &mut Criterion, dir: &Path) {
    let files: Vec<(DType, PathBuf)> = [DType::F32, DType::BF16, DType::F16]
        .into_iter()
        .map(|d| {
            let p = dir.join(format!("{d}.bin"));
            std::fs::write(&p, encoded(d)).unwrap();
            (d, p)
        })
        .collect();
    let path = |d: DType| files.iter().find(|f| f.0 == d).unwrap().1.clone();
    let mut g = c.benchmark_group("cast");
    g.sample_size(20);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Elements(N as u64));
    let cases = [
        ("copy f32", DType::F32, DType::F32),
        ("copy bf16", DType::BF16, DType::BF16),
        ("bf16 -> f32", DType::BF16, DType::F32),
        ("f16 -> f32", DType::F16, DType::F32),
        ("f32 -> bf16", DType::F32, DType::BF16),
        ("f32 -> f16", DType::F32, DType::F16),
    ];
    for (name, from, to) in cases {
        let ops = [whole(from, to)];
        let src = [path(from)];
        let mut out = vec![0u8; N * to.size()];
        g.bench_function(name, |b| {
            b.iter(|| read_into(&ops, Sources::local(&src), black_box(&mut out)).unwrap())
        });
        // The cast is exact for these values: check the first elements came out right.
        for i in [0, 1, 4095, N - 1] {
            let s = &out[i * to.size()..(i + 1) * to.size()];
            let got = match to {
                DType::F32 => f32::from_le_bytes(s.try_into().unwrap()),
                DType::BF16 => bf16::from_le_bytes(s.try_into().unwrap()).to_f32(),
                _ => f16::from_le_bytes(s.try_into().unwrap()).to_f32(),
            };
            let want = match (from, to) {
                (DType::BF16, _) | (_, DType::BF16) => bf16::from_f32(value(i)).to_f32(),
                (DType::F16, _) | (_, DType::F16) => f16::from_f32(value(i)).to_f32(),
                _ => value(i),
            };
            assert_eq!(got.to_bits(), want.to_bits(), "{name}, element {i}");
        }
    }
    g.finish();
}

/// Write 16 tensors of 1024 × 1024 `dtype` (from [`value`]) as one safetensors file.
fn write_model(path: &Path, dtype: DType) {
    let bytes = encoded(dtype);
    let st = match dtype {
        DType::F32 => Dtype::F32,
        _ => Dtype::BF16,
    };
    let tensors: Vec<&[u8]> = bytes.chunks(bytes.len() / 16).collect();
    common::write_safetensors(path, "", st, &[1024, 1024], &tensors);
}

fn bench_convert(c: &mut Criterion, dir: &Path) {
    let mut g = c.benchmark_group("convert --dtype");
    g.sample_size(10);
    g.sampling_mode(SamplingMode::Flat);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Elements(N as u64));
    for (name, from, to) in [
        ("f32 -> bf16, 1 file", DType::F32, DType::BF16),
        ("bf16 -> f32, 1 file", DType::BF16, DType::F32),
    ] {
        let src = dir.join(format!("{from}.safetensors"));
        write_model(&src, from);
        let dst = dir.join("out.safetensors");
        let mut opts = ConvertOptions::to(1);
        opts.dtype = Some(to);
        opts.format = Some(Format::SAFETENSORS);
        let job = prepare(&src, Some(&dst), &opts).unwrap();
        assert!(job.plan.ops.iter().all(|o| o.cast.is_some()));
        let exec = ExecOptions {
            sync: false,
            ..ExecOptions::default()
        };
        g.bench_function(name, |b| b.iter(|| common::execute_into(&job, &dst, &exec)));
        std::fs::remove_file(&src).unwrap();
        std::fs::remove_file(&dst).unwrap();
    }
    g.finish();
}

fn bench(c: &mut Criterion) {
    let tmp = tempfile::tempdir().unwrap();
    bench_read_into(c, tmp.path());
    bench_convert(c, tmp.path());
}

criterion_group!(benches, bench);
criterion_main!(benches);
