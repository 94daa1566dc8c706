//! Property tests of the algebra, planner and executor together: random shapes (0-d,
//! zero-size, prime and tiny dims), dtypes, placements and meshes, world sizes 1..=16.

use ndarray::{ArrayD, IxDyn, Slice};
use proptest::prelude::*;
use reshard::exec::{execute, ExecOptions, OutputFile, Sources};
use reshard::layout::{
    flat_ranges, DType, Loc, Mesh, Piece, Placement, Region, Sharding, TensorLayout,
};
use reshard::plan::{plan, CopyOp, Plan};
use std::path::PathBuf;

/// How a layout is generated: a sharding over a mesh, or flat ranges over `world` ranks.
#[derive(Clone, Debug)]
pub(crate) enum Scheme {
    Mesh(Sharding),
    Flat(u64),
}

impl Scheme {
    pub(crate) fn world(&self) -> u64 {
        match self {
            Scheme::Mesh(s) => s.mesh.world(),
            Scheme::Flat(w) => *w,
        }
    }

    fn rank_regions(&self, shape: &[u64], r: u64) -> Vec<Region> {
        match self {
            Scheme::Mesh(s) => s.rank_regions(shape, r),
            Scheme::Flat(w) => {
                let (shares, _) = flat_ranges(&[shape.to_vec()], *w);
                shares[r as usize]
                    .iter()
                    .flat_map(|(_, b)| b.clone())
                    .collect()
            }
        }
    }
}

/// Shapes of up to three dimensions, with the sizes that find edge cases (0, 1, primes).
pub(crate) fn shape_strategy() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(
        prop_oneof![
            Just(0u64),
            Just(1),
            Just(2),
            Just(3),
            Just(5),
            Just(7),
            Just(13),
            1u64..10
        ],
        0..=3,
    )
}

fn placement(ndim: usize) -> BoxedStrategy<Placement> {
    if ndim == 0 {
        return Just(Placement::Replicate).boxed();
    }
    prop_oneof![
        Just(Placement::Replicate),
        (0..ndim).prop_map(Placement::Shard),
        (0..ndim).prop_map(Placement::EvenShard),
        ((0..ndim), 1u64..=3).prop_map(|(d, k)| Placement::StridedShard(d, k)),
    ]
    .boxed()
}

pub(crate) fn scheme(ndim: usize) -> BoxedStrategy<Scheme> {
    let mesh1 = (1u64..=16).prop_flat_map(move |w| {
        placement(ndim).prop_map(move |p| {
            Scheme::Mesh(Sharding {
                mesh: Mesh(vec![w]),
                placements: vec![p],
            })
        })
    });
    let mesh2 = ((1u64..=4), (1u64..=4)).prop_flat_map(move |(a, b)| {
        (placement(ndim), placement(ndim)).prop_map(move |(p, q)| {
            Scheme::Mesh(Sharding {
                mesh: Mesh(vec![a, b]),
                placements: vec![p, q],
            })
        })
    });
    prop_oneof![3 => mesh1, 2 => mesh2, 1 => (1u64..=16).prop_map(Scheme::Flat)].boxed()
}

pub(crate) fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

/// The full tensor as an ndarray of bytes with a trailing dimension of the element size.
pub(crate) fn full_tensor(shape: &[u64], dtype: DType, seed: u64) -> ArrayD<u8> {
    let mut dims: Vec<usize> = shape.iter().map(|&s| s as usize).collect();
    dims.push(dtype.size());
    let mut x = seed | 1;
    ArrayD::from_shape_fn(IxDyn(&dims), |_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x as u8
    })
}

/// Bytes of `region` of `full`, row-major (or column-major: `reversed`), cut out with ndarray
/// slicing.
fn region_bytes(full: &ArrayD<u8>, region: &Region, reversed: bool) -> Vec<u8> {
    let mut v = full.view();
    for d in 0..region.ndim() {
        let (a, b) = (region.offsets[d] as isize, region.end(d) as isize);
        v.slice_axis_inplace(ndarray::Axis(d), Slice::from(a..b));
    }
    if reversed {
        // the dimensions in reverse order, the element's bytes kept last
        let n = region.ndim();
        let order: Vec<usize> = (0..n).rev().chain([n]).collect();
        v = v.permuted_axes(order);
    }
    v.iter().copied().collect()
}

/// A layout with rank r's regions stored back to back in file r; returns the layout and each
/// file's bytes (taken from `full` when given, zeros otherwise).
pub(crate) fn layout(
    name: &str,
    dtype: DType,
    shape: &[u64],
    s: &Scheme,
    full: Option<&ArrayD<u8>>,
) -> (TensorLayout, Vec<Vec<u8>>) {
    layout_stored(name, dtype, shape, s, full, false)
}

/// [`layout`], each piece stored column-major (strides given) when `reversed`.
pub(crate) fn layout_stored(
    name: &str,
    dtype: DType,
    shape: &[u64],
    s: &Scheme,
    full: Option<&ArrayD<u8>>,
    reversed: bool,
) -> (TensorLayout, Vec<Vec<u8>>) {
    let mut pieces = vec![];
    let mut files = vec![];
    for r in 0..s.world() {
        let mut bytes = vec![];
        for region in s.rank_regions(shape, r) {
            let offset = bytes.len() as u64;
            match full {
                Some(f) => bytes.extend(region_bytes(f, &region, reversed)),
                None => bytes.resize(bytes.len() + (region.volume() as usize) * dtype.size(), 0),
            }
            let strides = reversed.then(|| {
                let mut st = vec![1u64; region.ndim()];
                for d in 1..region.ndim() {
                    st[d] = st[d - 1] * region.sizes[d - 1];
                }
                st
            });
            pieces.push(Piece {
                rank: r as u32,
                region,
                loc: Loc {
                    file: r as u32,
                    offset,
                    strides,
                    pending: None,
                },
            });
        }
        files.push(bytes);
    }
    (
        TensorLayout {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            pieces,
        },
        files,
    )
}

/// Execute `plan` for real: sources and destinations are files in a temporary directory.
pub(crate) fn run(plan: &Plan, srcs: &[Vec<u8>], dst_sizes: &[usize]) -> Vec<Vec<u8>> {
    run_in_parts(plan, srcs, dst_sizes, 1)
}

/// [`run`], the plan split into `parts` parts ([`reshard::parts::split`]) each run on its own
/// (its plan restricted to its spans) into the same destination files, one after another.
pub(crate) fn run_in_parts(
    plan: &Plan,
    srcs: &[Vec<u8>],
    dst_sizes: &[usize],
    parts: u32,
) -> Vec<Vec<u8>> {
    let dir = tempfile::tempdir().unwrap();
    let src_paths: Vec<PathBuf> = srcs
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let p = dir.path().join(format!("src{i}"));
            std::fs::write(&p, b).unwrap();
            p
        })
        .collect();
    let outputs: Vec<OutputFile> = dst_sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| OutputFile {
            path: format!("dst{i}").into(),
            size: n as u64,
            literals: vec![],
            checksums: vec![],
        })
        .collect();
    let dst_paths: Vec<PathBuf> = outputs
        .iter()
        .map(|o| {
            let p = dir.path().join(&o.path);
            std::fs::File::create(&p).unwrap();
            p
        })
        .collect();
    // a tiny window so that ops are cut and reassembled across work units
    let opts = ExecOptions {
        threads: Some(2),
        window: 64,
        progress: None,
        sync: false,
    };
    if parts <= 1 {
        execute(
            plan,
            Sources::local(&src_paths),
            &outputs,
            &dst_paths,
            &opts,
        )
        .unwrap();
    } else {
        let sizes: Vec<u64> = outputs.iter().map(|o| o.size).collect();
        for spans in reshard::parts::split(&sizes, plan, parts).unwrap() {
            let own = reshard::exec::restrict(plan, &spans);
            let sources = Sources::local(&src_paths);
            reshard::exec::execute_part(&own, sources, &outputs, &dst_paths, &opts, &spans)
                .unwrap();
        }
    }
    dst_paths
        .iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect()
}

/// Count how often each destination byte is written by `ops` (reference interpretation).
fn write_counts(ops: &[CopyOp], dst_sizes: &[usize]) -> Vec<Vec<u32>> {
    let mut c: Vec<Vec<u32>> = dst_sizes.iter().map(|&n| vec![0; n]).collect();
    for o in ops {
        for r in 0..o.count {
            let d = (o.dst_offset + r * o.dst_stride) as usize;
            for b in &mut c[o.dst as usize][d..d + o.dst_len() as usize] {
                *b += 1;
            }
        }
    }
    c
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 1500,
        failure_persistence: crate::common::regressions("layout_props"),
        ..ProptestConfig::default()
    })]

    /// N → M → N gives back the source files byte for byte; N → 1 equals the full tensor
    /// assembled with ndarray; every plan reads exactly the bytes it writes, and writes each
    /// destination byte of a non-empty piece exactly once.
    #[test]
    fn reshard_round_trips(
        (shape, a, b) in shape_strategy().prop_flat_map(|s| { let n = s.len(); (Just(s), scheme(n), scheme(n)) }),
        dt in dtype(),
        seed in any::<u64>(),
    ) {
        let full = full_tensor(&shape, dt, seed);
        let (src, src_files) = layout("t", dt, &shape, &a, Some(&full));
        let (mid, mid_zero) = layout("t", dt, &shape, &b, None);
        let sizes: Vec<usize> = mid_zero.iter().map(Vec::len).collect();

        let p1 = plan(std::slice::from_ref(&src), std::slice::from_ref(&mid)).unwrap();
        prop_assert_eq!(p1.bytes_read(), p1.bytes_written());
        let counts = write_counts(&p1.ops, &sizes);
        let dst_bytes: usize = sizes.iter().sum();
        let once: usize = counts.iter().flatten().filter(|&&c| c == 1).count();
        prop_assert!(counts.iter().flatten().all(|&c| c <= 1), "a destination byte written twice");
        prop_assert_eq!(once, dst_bytes, "a destination byte not written");
        let mid_files = run(&p1, &src_files, &sizes);

        // and back to the source layout
        let (back, back_zero) = layout("t", dt, &shape, &a, None);
        let back_sizes: Vec<usize> = back_zero.iter().map(Vec::len).collect();
        let p2 = plan(std::slice::from_ref(&mid), std::slice::from_ref(&back)).unwrap();
        let back_files = run(&p2, &mid_files, &back_sizes);
        prop_assert_eq!(&back_files, &src_files);

        // N -> 1 against the independently assembled full tensor
        let one = Scheme::Mesh(Sharding::fsdp(1));
        let (whole, whole_zero) = layout("t", dt, &shape, &one, None);
        let p3 = plan(std::slice::from_ref(&src), std::slice::from_ref(&whole)).unwrap();
        let out = run(&p3, &src_files, &[whole_zero[0].len()]);
        prop_assert_eq!(&out[0], &full.iter().copied().collect::<Vec<u8>>());
    }

    /// Validation rejects every gap and every overlap made from a valid layout.
    #[test]
    fn validation_rejects_gaps_and_overlaps(
        (shape, s) in shape_strategy().prop_flat_map(|s| { let n = s.len(); (Just(s), scheme(n)) }),
        pick in any::<prop::sample::Index>(),
        dim in any::<prop::sample::Index>(),
    ) {
        let (l, _) = layout("t", DType::F32, &shape, &s, None);
        prop_assert!(l.validate().is_ok());
        let nonempty: Vec<usize> = (0..l.pieces.len()).filter(|&i| !l.pieces[i].region.is_empty()).collect();
        if nonempty.is_empty() {
            return Ok(()); // a zero-size tensor: nothing to take away
        }
        let victim = l.pieces[nonempty[pick.index(nonempty.len())]].region.clone();

        // gap: drop the region and all its replicas
        let mut gap = l.clone();
        gap.pieces.retain(|p| p.region != victim);
        let e = gap.validate().unwrap_err().to_string();
        prop_assert!(e.contains("not covered"), "{}", e);

        // overlap: grow the region by one along a dimension where it is not whole
        let full = Region::full(&shape);
        let dims: Vec<usize> = (0..shape.len()).filter(|&d| victim.sizes[d] < full.sizes[d]).collect();
        if dims.is_empty() {
            return Ok(()); // the piece is the whole tensor (replicated): it cannot grow
        }
        let d = dims[dim.index(dims.len())];
        let mut grown = victim.clone();
        if grown.end(d) < shape[d] { grown.sizes[d] += 1 } else { grown.offsets[d] -= 1; grown.sizes[d] += 1 }
        let mut over = l.clone();
        let i = over.pieces.iter().position(|p| p.region == victim).unwrap();
        over.pieces[i].region = grown;
        let e = over.validate().unwrap_err().to_string();
        prop_assert!(e.contains("overlap"), "{}", e);
    }

    /// bf16 → f32 → bf16 through the executor's casts is exact for finite values.
    #[test]
    fn casts_round_trip(vals in prop::collection::vec(any::<u16>().prop_filter("finite", |b| (b >> 7) & 0xff != 0xff), 1..200), m in 1u64..=5) {
        let n = vals.len() as u64;
        let src_bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let src = TensorLayout { name: "t".into(), dtype: DType::BF16, shape: vec![n],
            pieces: vec![Piece { rank: 0, region: Region::full(&[n]), loc: Loc { file: 0, offset: 0, strides: None, pending: None } }] };
        let (mut wide, wide_zero) = layout("t", DType::F32, &[n], &Scheme::Mesh(Sharding::fsdp(m)), None);
        wide.dtype = DType::F32;
        let sizes: Vec<usize> = wide_zero.iter().map(Vec::len).collect();
        let p = plan(std::slice::from_ref(&src), std::slice::from_ref(&wide)).unwrap();
        prop_assert_eq!(p.bytes_written(), n * 4);
        let mid = run(&p, std::slice::from_ref(&src_bytes), &sizes);
        let mut narrow = src.clone();
        narrow.pieces[0].loc.file = 0;
        let p2 = plan(std::slice::from_ref(&wide), std::slice::from_ref(&narrow)).unwrap();
        let back = run(&p2, &mid, &[src_bytes.len()]);
        prop_assert_eq!(&back[0], &src_bytes);
    }
}
