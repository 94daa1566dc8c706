//! Planner benchmarks: how long planning takes for large checkpoints, without touching data.
//!
//! Group `plan` plans 1024 → 768 ranks for a scaling curve of each layout kind: flat ranges
//! (ZeRO / FSDP1 flat parameters) of 12,500 to 200,000 tensors, and FSDP2's `Shard(0)` of 125
//! to 1,000 tensors. Each case's throughput is in chunks (source plus target pieces) per
//! second, so time per chunk reads off directly and a flat curve means linear time.
//!
//! `cargo bench --bench planner` (about 2–3 minutes) — figures go in BENCHMARKS.md. One point:
//! `cargo bench --bench planner -- 'flat 200k'`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use reshard::layout::{flat_ranges, DType, Loc, Piece, Region, Sharding, TensorLayout};
use reshard::plan::plan;
use std::hint::black_box;
use std::time::Duration;

/// Rank `rank`'s piece `region`, stored row-major at byte `offset` of file `rank`.
fn stored(rank: u64, region: Region, offset: u64) -> Piece {
    Piece {
        rank: rank as u32,
        region,
        loc: Loc {
            file: rank as u32,
            offset,
            strides: None,
            pending: None,
        },
    }
}

/// `n` tensors of shapes (rows, 64) laid out as flat ranges (ZeRO / FSDP1 flat parameters)
/// over `world` ranks; each rank's range is stored back to back in its own file.
fn flat_layouts(n: usize, world: u64) -> Vec<TensorLayout> {
    let shapes: Vec<Vec<u64>> = (0..n)
        .map(|i| vec![1 + (i as u64 * 7919) % 61, 64])
        .collect();
    let (shares, chunk) = flat_ranges(&shapes, world);
    let mut layouts: Vec<TensorLayout> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| TensorLayout {
            name: format!("layers.{i}.weight"),
            dtype: DType::BF16,
            shape: s.clone(),
            pieces: vec![],
        })
        .collect();
    for (r, share) in shares.into_iter().enumerate() {
        let mut off = 0u64;
        for (t, boxes) in share {
            for region in boxes {
                let n = region.volume() * 2;
                layouts[t].pieces.push(stored(r as u64, region, off));
                off += n;
            }
        }
        debug_assert!(off <= chunk * 2);
    }
    layouts
}

/// `n` tensors of shape (rows, 256), each `Shard(0)` over `world` ranks (FSDP2).
fn fsdp_layouts(n: usize, world: u64) -> Vec<TensorLayout> {
    let s = Sharding::fsdp(world);
    let mut offsets = vec![0u64; world as usize];
    (0..n)
        .map(|i| {
            let shape = vec![3000 + (i as u64 % 17), 256];
            let pieces = (0..world)
                .flat_map(|r| s.rank_regions(&shape, r).into_iter().map(move |g| (r, g)))
                .map(|(r, region)| {
                    let off = offsets[r as usize];
                    offsets[r as usize] += region.volume() * 2;
                    stored(r, region, off)
                })
                .collect();
            TensorLayout {
                name: format!("t{i}"),
                dtype: DType::BF16,
                shape,
                pieces,
            }
        })
        .collect()
}

/// Source plus target pieces: the size the planner's sweep is linear in.
fn chunks(src: &[TensorLayout], dst: &[TensorLayout]) -> u64 {
    src.iter().chain(dst).map(|t| t.pieces.len() as u64).sum()
}

/// `12.5k`, `100k`: tensor counts as the case names show them.
fn thousands(n: usize) -> String {
    if n % 1000 == 0 {
        format!("{}k", n / 1000)
    } else {
        format!("{}k", n as f64 / 1000.0)
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan");
    // Big cases take 0.1–2.5 s an iteration: 10 samples, no more time than they need.
    g.sample_size(10);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(3));
    for n in [12_500usize, 25_000, 50_000, 100_000, 200_000] {
        let src = flat_layouts(n, 1024);
        let dst = flat_layouts(n, 768);
        g.throughput(Throughput::Elements(chunks(&src, &dst)));
        g.bench_function(
            format!("flat {} tensors 1024->768 ranks", thousands(n)),
            |b| b.iter(|| black_box(plan(&src, &dst).unwrap())),
        );
    }
    for n in [125usize, 250, 500, 1000] {
        let src = fsdp_layouts(n, 1024);
        let dst = fsdp_layouts(n, 768);
        let chunks = chunks(&src, &dst);
        g.throughput(Throughput::Elements(chunks));
        g.bench_function(
            format!("Shard(0) {n} tensors 1024->768 ranks ({chunks} chunks)"),
            |b| b.iter(|| black_box(plan(&src, &dst).unwrap())),
        );
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
