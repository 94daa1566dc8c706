//! Views (target tensors defined through transforms of source tensors) planned against
//! random source and target placements, executed by a reference executor on bytes in memory,
//! and judged bit for bit against the same view computed by ndarray on the full tensors;
//! and the conversions between Megatron and Hugging Face that views exist for.

use crate::layout_props::{
    dtype, full_tensor, layout, layout_stored, run, run_in_parts, scheme, Scheme,
};
use ndarray::{ArrayD, Axis, IxDyn, Slice};
use proptest::prelude::*;
use reshard::layout::{Mesh, Placement, Sharding, TensorLayout, View};
use reshard::plan::{plan, plan_views, Plan};
use std::collections::HashMap;

/// `view` computed by ndarray on the full source tensors (bytes, with a trailing dimension
/// of the element's bytes); `fill` gives a fill value's element bytes.
fn reference(
    view: &View,
    src: &HashMap<String, ArrayD<u8>>,
    fill: &dyn Fn(f64) -> Vec<u8>,
) -> ArrayD<u8> {
    let reshape = |a: ArrayD<u8>, dims: Vec<usize>| -> ArrayD<u8> {
        a.to_shape(IxDyn(&dims)).unwrap().to_owned()
    };
    match view {
        View::Source { name } => src[name].clone(),
        View::Slice {
            of,
            dim,
            start,
            len,
        } => {
            let a = reference(of, src, fill);
            let (s, e) = (*start as isize, (*start + *len) as isize);
            a.slice_axis(Axis(*dim), Slice::from(s..e)).to_owned()
        }
        View::Split { of, dim, sizes } => {
            let a = reference(of, src, fill);
            let mut dims = a.shape().to_vec();
            dims.splice(*dim..=*dim, sizes.iter().map(|&s| s as usize));
            reshape(a, dims)
        }
        View::Merge { of, dim, count } => {
            let a = reference(of, src, fill);
            let mut dims = a.shape().to_vec();
            let n: usize = dims[*dim..*dim + *count].iter().product();
            dims.splice(*dim..*dim + *count, [n]);
            reshape(a, dims)
        }
        View::Permute { of, order } => {
            let a = reference(of, src, fill);
            let axes: Vec<usize> = order.iter().copied().chain([order.len()]).collect();
            a.permuted_axes(axes)
        }
        View::Concat { dim, parts } => {
            let arrays: Vec<ArrayD<u8>> = parts.iter().map(|p| reference(p, src, fill)).collect();
            let views: Vec<_> = arrays.iter().map(|a| a.view()).collect();
            ndarray::concatenate(Axis(*dim), &views).unwrap()
        }
        View::Pad {
            of,
            dim,
            before,
            after,
            fill: value,
        } => {
            let a = reference(of, src, fill);
            let mut dims = a.shape().to_vec();
            let n = dims[*dim];
            dims[*dim] += (*before + *after) as usize;
            let bytes = fill(value.0);
            let mut out = ArrayD::from_shape_fn(IxDyn(&dims), |i| bytes[i[dims.len() - 1]]);
            let (s, e) = (*before as isize, (*before as usize + n) as isize);
            out.slice_axis_mut(Axis(*dim), Slice::from(s..e)).assign(&a);
            out
        }
    }
}

/// Run the plan's copies and fills on in-memory files; returns the destination files and how
/// often each byte was written.
fn run_in_memory(
    plan: &Plan,
    srcs: &[Vec<u8>],
    dst_sizes: &[usize],
) -> (Vec<Vec<u8>>, Vec<Vec<u32>>) {
    let mut out: Vec<Vec<u8>> = dst_sizes.iter().map(|&n| vec![0xEE; n]).collect();
    let mut count: Vec<Vec<u32>> = dst_sizes.iter().map(|&n| vec![0; n]).collect();
    for o in &plan.ops {
        for r in 0..o.count {
            let s = (o.src_offset + r * o.src_stride) as usize;
            let d = (o.dst_offset + r * o.dst_stride) as usize;
            let (src, dst) = (
                &srcs[o.src as usize][s..s + o.len as usize],
                &mut out[o.dst as usize][d..d + o.dst_len() as usize],
            );
            match o.cast {
                Some(c) => reshard::layout::cast::convert(c.from, c.to, src, dst),
                None => dst.copy_from_slice(src),
            }
            count[o.dst as usize][d..d + o.dst_len() as usize]
                .iter_mut()
                .for_each(|c| *c += 1);
        }
    }
    for f in &plan.fills {
        for r in 0..f.count {
            let d = (f.dst_offset + r * f.dst_stride) as usize;
            let row = &mut out[f.dst as usize][d..d + f.len as usize];
            for (i, b) in row.iter_mut().enumerate() {
                *b = f.value[i % f.value.len()];
            }
            count[f.dst as usize][d..d + f.len as usize]
                .iter_mut()
                .for_each(|c| *c += 1);
        }
    }
    (out, count)
}

/// Choices drawn from a stream of numbers (so that one stream builds a view and, replayed,
/// a sibling of the same shape over other sources).
struct Gen<'a> {
    stream: &'a [u32],
    at: usize,
    /// Source names and shapes; sources 2k and 2k+1 share a shape.
    sources: &'a [(String, Vec<u64>)],
}

impl Gen<'_> {
    fn pick(&mut self, n: u64) -> u64 {
        let v = self.stream.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        v as u64 % n.max(1)
    }

    /// A random valid view and its shape; `swap` reads each leaf's partner of the same shape.
    fn view(&mut self, depth: u32, swap: bool) -> (View, Vec<u64>) {
        let op = if depth == 0 { 0 } else { self.pick(9) };
        let leaf = |g: &mut Self| {
            let k = g.pick(g.sources.len() as u64) as usize ^ usize::from(swap);
            let (name, shape) = &g.sources[k];
            (View::source(name.clone()), shape.clone())
        };
        if op == 0 {
            return leaf(self);
        }
        let start_at = self.at;
        let (v, shape) = self.view(depth - 1, swap);
        let n = shape.len() as u64;
        match op {
            1 | 2 if n > 0 => {
                let d = self.pick(n) as usize;
                // mostly long slices, off any factor's boundary
                let (start, len) = self.range(shape[d]);
                let mut s = shape.clone();
                s[d] = len;
                (v.slice(d, start, len), s)
            }
            3 | 4 if n > 0 && n < 5 => {
                // mostly the largest dimension
                let d = match self.pick(3) {
                    0 => self.pick(n) as usize,
                    _ => (0..n as usize).max_by_key(|&d| shape[d]).unwrap(),
                };
                let sizes = self.factors(shape[d]);
                let mut s = shape.clone();
                s.splice(d..=d, sizes.iter().copied());
                (v.split(d, &sizes), s)
            }
            5 => {
                let d = self.pick(n + 1) as usize;
                let count = self.pick(n - d as u64 + 1) as usize;
                let mut s = shape.clone();
                let m = s[d..d + count].iter().product();
                s.splice(d..d + count, [m]);
                (v.merge(d, count), s)
            }
            6 if n > 1 => {
                let mut order: Vec<usize> = (0..n as usize).collect();
                for i in (1..order.len()).rev() {
                    let j = self.pick(i as u64 + 1) as usize;
                    order.swap(i, j);
                }
                let s = order.iter().map(|&o| shape[o]).collect();
                (v.permute(&order), s)
            }
            7 if n > 0 => {
                // the operand again, or its sibling over the partner sources (the same
                // choices replayed), each sliced
                let d = self.pick(n) as usize;
                let parts = 1 + self.pick(3);
                let mut views = vec![];
                let mut s = shape.clone();
                s[d] = 0;
                for _ in 0..parts {
                    let p = if self.pick(2) == 0 {
                        v.clone()
                    } else {
                        let here = self.at;
                        self.at = start_at;
                        let (p, ps) = self.view(depth - 1, !swap);
                        assert_eq!(ps, shape, "a sibling has the operand's shape");
                        self.at = here;
                        p
                    };
                    let (start, len) = self.range(shape[d]);
                    s[d] += len;
                    views.push(p.slice(d, start, len));
                }
                (View::concat(d, views), s)
            }
            8 if n > 0 => {
                let d = self.pick(n) as usize;
                let (before, after) = (self.pick(3), self.pick(3));
                let fill = [0.0, 1.0, 2.0, 0.5][self.pick(4) as usize];
                let mut s = shape.clone();
                s[d] += before + after;
                (v.pad(d, before, after, fill), s)
            }
            _ => (v, shape),
        }
    }

    /// A range `(start, len)` of `0..n`: mostly long (but for up to two indices at its
    /// end), off any factor's boundary; now and then any, empty included.
    fn range(&mut self, n: u64) -> (u64, u64) {
        let start = self.pick(n / 2 + 1);
        let room = n - start;
        let len = match self.pick(8) {
            0 => self.pick(room + 1),
            _ if room > 2 => room - self.pick(3),
            _ => room,
        };
        (start, len)
    }

    /// `n` as a product of up to three factors (a size of 1 may also vanish into none).
    fn factors(&mut self, n: u64) -> Vec<u64> {
        if n == 1 && self.pick(3) == 0 {
            return vec![];
        }
        if n == 0 {
            return vec![0, 1 + self.pick(3)];
        }
        let mut out = vec![];
        let mut rest = n;
        for _ in 0..self.pick(3) {
            let divs: Vec<u64> = (1..=rest).filter(|f| rest % f == 0).collect();
            let f = divs[self.pick(divs.len() as u64) as usize];
            out.push(f);
            rest /= f;
        }
        out.push(rest);
        out
    }
}

fn sizes_of(files: &[Vec<u8>]) -> Vec<usize> {
    files.iter().map(Vec::len).collect()
}

/// Plan `view` of the sources into target `dst`, run it in memory, and check the target's
/// files against `expected`: every byte written once, copies reading what they write.
fn check_plan(
    srcs: &[(TensorLayout, Vec<Vec<u8>>)],
    dst: &TensorLayout,
    view: &View,
    expected: &[Vec<u8>],
) -> Result<Plan, TestCaseError> {
    // the sources' files, numbered one after another
    let mut files = vec![];
    let mut layouts = vec![];
    for (l, f) in srcs {
        let mut l = l.clone();
        for p in &mut l.pieces {
            p.loc.file += files.len() as u32;
        }
        files.extend(f.iter().cloned());
        layouts.push(l);
    }
    let p = plan_views(
        layouts.iter().map(|l| (l.name.as_str(), l)),
        &[(dst.clone(), view.clone())],
    )
    .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let (out, count) = run_in_memory(&p, &files, &sizes_of(expected));
    prop_assert_eq!(p.bytes_read(), p.bytes_written());
    prop_assert!(
        count.iter().flatten().all(|&c| c == 1),
        "a destination byte written {} times",
        count.iter().flatten().find(|&&c| c != 1).unwrap()
    );
    prop_assert_eq!(
        &out,
        expected,
        "view {}",
        serde_json::to_string(view).unwrap()
    );
    Ok(p)
}

/// Sources a, b of one shape and c, d of another, each over its own placement, some stored
/// column-major.
type SourceSpec = (Vec<u64>, Scheme, bool);

fn composite_shape() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(
        prop_oneof![
            1 => Just(0u64),
            6 => Just(1),
            24 => prop::sample::select(vec![2u64, 3, 4, 6, 8, 12, 16, 24, 36]),
            6 => 1u64..10,
        ],
        0..=3,
    )
}

fn sources() -> impl Strategy<Value = Vec<SourceSpec>> {
    (composite_shape(), composite_shape()).prop_flat_map(|(s, t)| {
        let one = |s: Vec<u64>| {
            let n = s.len();
            (Just(s), scheme(n), any::<bool>())
        };
        (one(s.clone()), one(s), one(t.clone()), one(t)).prop_map(|(a, b, c, d)| vec![a, b, c, d])
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 1000,
        failure_persistence: crate::common::regressions("views"),
        ..ProptestConfig::default()
    })]

    /// A random view of random sources, over random source and target placements, planned
    /// and executed equals ndarray's view of the full tensors, bit for bit; every target
    /// byte is written once (copied or filled) and copies read the bytes they write. The plan
    /// also runs through the real executor (in windows of 64 bytes), whole and split into
    /// parts, padding included.
    #[test]
    fn views_plan_as_ndarray_computes_them(
        specs in sources(),
        stream in prop::collection::vec(any::<u32>(), 128),
        depth in 1u32..=5,
        dt in dtype(),
        seed in any::<u64>(),
        target_pick in any::<u64>(),
    ) {
        let names = ["a", "b", "c", "d"];
        let named: Vec<(String, Vec<u64>)> =
            names.iter().zip(&specs).map(|(n, s)| (n.to_string(), s.0.clone())).collect();
        let mut g = Gen { stream: &stream, at: 0, sources: &named };
        let (view, shape) = g.view(depth, false);
        if shape.iter().product::<u64>() > 50_000 || shape.len() > 6 {
            return Ok(());
        }
        let mut fulls = HashMap::new();
        let mut srcs = vec![];
        for (i, (n, (s, sch, rev))) in names.iter().zip(&specs).enumerate() {
            let full = full_tensor(s, dt, seed.wrapping_add(i as u64));
            srcs.push(layout_stored(n, dt, s, sch, Some(&full), *rev));
            fulls.insert(n.to_string(), full);
        }
        // a fill value the dtype cannot hold is refused when planned (checked below)
        let fill = |v: f64| reshard::layout::Fill(v).bytes(dt).unwrap_or_else(|_| vec![0; dt.size()]);
        let want = reference(&view, &fulls, &fill);
        prop_assert_eq!(want.shape()[..shape.len()].to_vec(), shape.iter().map(|&s| s as usize).collect::<Vec<_>>());
        let ts = target(&shape, target_pick);
        let (dst, expected) = layout("t", dt, &shape, &ts, Some(&want));
        let has_unholdable_fill = has_fill(&view, &|v| reshard::layout::Fill(v).bytes(dt).is_err());
        let p = match check_plan(&srcs, &dst, &view, &expected) {
            Err(e) if has_unholdable_fill => {
                prop_assert!(e.to_string().contains("fill value"), "{}", e);
                return Ok(());
            }
            r => r?,
        };
        let mut files = vec![];
        for (_, f) in &srcs {
            files.extend(f.iter().cloned());
        }
        // the planner numbered the files of a, b, c, d one after another
        let out = run(&p, &files, &sizes_of(&expected));
        prop_assert_eq!(&out, &expected);
        let parts = 2 + (seed % 3) as u32;
        let out = run_in_parts(&p, &files, &sizes_of(&expected), parts);
        prop_assert_eq!(&out, &expected, "in {} parts", parts);
    }

    /// The identity view plans exactly the copies `plan` does.
    #[test]
    fn identity_views_plan_as_plan(
        (shape, a, b) in crate::layout_props::shape_strategy().prop_flat_map(|s| { let n = s.len(); (Just(s), scheme(n), scheme(n)) }),
        dt in dtype(),
    ) {
        let (src, _) = layout("t", dt, &shape, &a, None);
        let (dst, _) = layout("t", dt, &shape, &b, None);
        let want = plan(std::slice::from_ref(&src), std::slice::from_ref(&dst)).unwrap();
        let got = plan_views([("t", &src)], &[(dst, View::source("t"))]).unwrap();
        prop_assert_eq!(&got.ops, &want.ops);
        prop_assert!(got.fills.is_empty());
        prop_assert_eq!(&got.tensors, &want.tensors);
    }
}

/// A target placement for a tensor of `shape`, drawn from `k`: flat ranges, or one or two
/// placements over a 1-d or 2-d mesh.
fn target(shape: &[u64], k: u64) -> Scheme {
    let n = shape.len();
    let world = 1 + k % 7;
    let place = |j: u64| -> Placement {
        if n == 0 {
            return Placement::Replicate;
        }
        let d = (j / 5) as usize % n;
        match j % 5 {
            0 => Placement::Replicate,
            1 | 2 => Placement::Shard(d),
            3 => Placement::EvenShard(d),
            _ => Placement::StridedShard(d, 1 + (j / 7) % 3),
        }
    };
    match (k / 7) % 4 {
        0 => Scheme::Flat(world),
        1 => Scheme::Mesh(Sharding {
            mesh: Mesh(vec![1 + k % 3, 1 + (k / 3) % 3]),
            placements: vec![place(k / 28), place(k / 300)],
        }),
        _ => Scheme::Mesh(Sharding {
            mesh: Mesh(vec![world]),
            placements: vec![place(k / 28)],
        }),
    }
}

/// True when `view` pads with a value `bad` says of.
fn has_fill(view: &View, bad: &dyn Fn(f64) -> bool) -> bool {
    match view {
        View::Source { .. } => false,
        View::Pad { of, fill, .. } => bad(fill.0) || has_fill(of, bad),
        View::Slice { of, .. }
        | View::Split { of, .. }
        | View::Merge { of, .. }
        | View::Permute { of, .. } => has_fill(of, bad),
        View::Concat { parts, .. } => parts.iter().any(|p| has_fill(p, bad)),
    }
}

/// A 2-d i16 tensor of `rows` × `cols` whose element (r, c) is `value(r, c)`, as bytes.
fn table(rows: u64, cols: u64, value: impl Fn(u64, u64) -> u16) -> ArrayD<u8> {
    let dims = [rows as usize, cols as usize, 2];
    ArrayD::from_shape_fn(IxDyn(&dims), |i| {
        value(i[0] as u64, i[1] as u64).to_le_bytes()[i[2]]
    })
}

/// `name` of `full` (2-d i16) held over `scheme`, with its files.
fn held(name: &str, full: &ArrayD<u8>, scheme: Scheme) -> (TensorLayout, Vec<Vec<u8>>) {
    let shape: Vec<u64> = full.shape()[..2].iter().map(|&s| s as u64).collect();
    layout(
        name,
        reshard::layout::DType::I16,
        &shape,
        &scheme,
        Some(full),
    )
}

fn tp(n: u64) -> Scheme {
    Scheme::Mesh(Sharding::fsdp(n))
}

/// Megatron's fused QKV rows, `(ng·(hpg+2)·hd, H)` with the query groups outermost and held
/// `Shard(0)` over tensor-parallel ranks, to Hugging Face's q, k and v and back.
#[test]
fn fused_qkv_to_q_k_v_and_back() {
    let (ng, hpg, hd, h) = (4u64, 3u64, 2u64, 5u64);
    let rows = ng * (hpg + 2) * hd;
    let fused = table(rows, h, |r, c| (r * h + c) as u16);
    let src = held("qkv", &fused, tp(2));
    let split = || View::source("qkv").split(0, &[ng, hpg + 2, hd]);
    // the rows of q, k and v, by the index arithmetic of Megatron's layout
    let q_row = |r: u64| (r / (hpg * hd)) * (hpg + 2) * hd + r % (hpg * hd);
    let k_row = |r: u64| (r / hd) * (hpg + 2) * hd + hpg * hd + r % hd;
    let v_row = |r: u64| k_row(r) + hd;
    type Rows<'a> = &'a dyn Fn(u64) -> u64;
    let cases: [(&str, View, u64, Rows); 3] = [
        (
            "q",
            split().slice(1, 0, hpg).merge(0, 3),
            ng * hpg * hd,
            &q_row,
        ),
        ("k", split().slice(1, hpg, 1).merge(0, 3), ng * hd, &k_row),
        (
            "v",
            split().slice(1, hpg + 1, 1).merge(0, 3),
            ng * hd,
            &v_row,
        ),
    ];
    let mut hf = vec![];
    for (name, view, n, row) in cases {
        let want = table(n, h, |r, c| (row(r) * h + c) as u16);
        for ranks in [1, 3] {
            let (dst, expected) = held(name, &want, tp(ranks));
            check_plan(std::slice::from_ref(&src), &dst, &view, &expected).unwrap();
        }
        // q's rows are whole groups of heads: one strided copy per source rank
        if name == "q" {
            let (dst, _) = held(name, &want, tp(1));
            let p = plan_views([("qkv", &src.0)], &[(dst, view.clone())]).unwrap();
            assert_eq!(p.ops.len(), 2, "{:?}", p.ops);
            assert!(p
                .ops
                .iter()
                .all(|o| o.count == ng / 2 && o.len == hpg * hd * h * 2));
        }
        hf.push(held(name, &want, tp(3)));
    }
    // and back: the fused tensor from q, k and v, over two ranks
    let back = View::concat(
        1,
        vec![
            View::source("q").split(0, &[ng, hpg, hd]),
            View::source("k").split(0, &[ng, 1, hd]),
            View::source("v").split(0, &[ng, 1, hd]),
        ],
    )
    .merge(0, 3);
    let (dst, expected) = held("qkv", &fused, tp(2));
    assert_eq!(expected, src.1);
    check_plan(&hf, &dst, &back, &expected).unwrap();
}

/// Hugging Face's gate and up projections concatenated into Megatron's fc1, and gate read back
/// from a tensor-parallel fc1 whose ranks each hold their own [gate; up] rows.
#[test]
fn gate_and_up_concatenate_and_split_back_from_tensor_parallel_rows() {
    let (f, h, tp_ranks) = (6u64, 4u64, 2u64);
    let gate = table(f, h, |r, c| (r * h + c) as u16);
    let up = table(f, h, |r, c| (1000 + r * h + c) as u16);
    let srcs = [held("gate", &gate, tp(2)), held("up", &up, tp(3))];
    let fc1 = table(2 * f, h, |r, c| {
        if r < f {
            (r * h + c) as u16
        } else {
            (1000 + (r - f) * h + c) as u16
        }
    });
    let view = View::concat(0, vec![View::source("gate"), View::source("up")]);
    let (dst, expected) = held("fc1", &fc1, tp(4));
    check_plan(&srcs, &dst, &view, &expected).unwrap();

    // Megatron's global fc1 under TP: rank t holds gate rows t·f/tp.. then up's
    let per = f / tp_ranks;
    let megatron = table(2 * f, h, |r, c| {
        let (t, i) = (r / (2 * per), r % (2 * per));
        if i < per {
            ((t * per + i) * h + c) as u16
        } else {
            (1000 + (t * per + i - per) * h + c) as u16
        }
    });
    let src = held("fc1", &megatron, tp(tp_ranks));
    let gate_view = View::source("fc1")
        .split(0, &[tp_ranks, 2, per])
        .slice(1, 0, 1)
        .merge(0, 3);
    let (dst, expected) = held("gate", &gate, tp(1));
    check_plan(std::slice::from_ref(&src), &dst, &gate_view, &expected).unwrap();
}

/// A vocabulary padded for tensor parallelism trimmed to its real rows, and padded back with
/// a stated value: the padding is written by fills, never left as it was.
#[test]
fn vocabulary_trim_and_pad() {
    let (vocab, padded, h) = (7u64, 10u64, 3u64);
    let embed = table(padded, h, |r, c| {
        if r < vocab {
            (r * h + c) as u16
        } else {
            0xdead
        }
    });
    let src = held("embed", &embed, tp(2));
    let real = table(vocab, h, |r, c| (r * h + c) as u16);
    let trim = View::source("embed").slice(0, 0, vocab);
    let (dst, expected) = held("embed", &real, tp(3));
    let p = check_plan(std::slice::from_ref(&src), &dst, &trim, &expected).unwrap();
    assert!(p.fills.is_empty());
    assert_eq!(p.bytes_read(), vocab * h * 2);

    let hf = held("embed", &real, tp(3));
    for (value, bytes) in [(0.0, 0u16), (7.0, 7)] {
        let pad = View::source("embed").pad(0, 0, padded - vocab, value);
        let want = table(padded, h, |r, c| {
            if r < vocab {
                (r * h + c) as u16
            } else {
                bytes
            }
        });
        let (dst, expected) = held("embed", &want, tp(2));
        let p = check_plan(std::slice::from_ref(&hf), &dst, &pad, &expected).unwrap();
        assert_eq!(p.bytes_filled(), (padded - vocab) * h * 2);
        assert!(p.fills.iter().all(|f| f.value == bytes.to_le_bytes()));
    }
}

/// Views are data: they round-trip through JSON, and a plan names the view of each tensor
/// that is not simply its source of the same name. A plan without views serialises as before.
#[test]
fn views_serialise_and_show_in_the_plan() {
    let q = View::source("qkv")
        .split(0, &[2, 5, 4])
        .slice(1, 0, 3)
        .merge(0, 3);
    let json = serde_json::to_string(&q).unwrap();
    assert_eq!(
        json,
        r#"{"op":"merge","of":{"op":"slice","of":{"op":"split","of":{"op":"source","name":"qkv"},"dim":0,"sizes":[2,5,4]},"dim":1,"start":0,"len":3},"dim":0,"count":3}"#
    );
    assert_eq!(serde_json::from_str::<View>(&json).unwrap(), q);
    let pad = View::source("e").pad(0, 1, 2, -0.5);
    let back: View = serde_json::from_str(&serde_json::to_string(&pad).unwrap()).unwrap();
    assert_eq!(back, pad);

    let fused = table(40, 2, |r, c| (r * 2 + c) as u16);
    let src = held("qkv", &fused, tp(1));
    let (dst, _) = held("q", &table(24, 2, |_, _| 0), tp(1));
    let p = plan_views([("qkv", &src.0)], &[(dst, q.clone())]).unwrap();
    assert_eq!(p.tensors[0].view.as_ref(), Some(&q));
    let v = serde_json::to_value(&p).unwrap();
    assert_eq!(v["tensors"][0]["view"], serde_json::to_value(&q).unwrap());
    assert!(v.get("fills").is_none());

    let (same, _) = held("qkv", &fused, tp(2));
    let p = plan_views([("qkv", &src.0)], &[(same.clone(), View::source("qkv"))]).unwrap();
    let old = plan(std::slice::from_ref(&src.0), &[same]).unwrap();
    assert_eq!(
        serde_json::to_string(&p).unwrap(),
        serde_json::to_string(&old).unwrap()
    );
    assert!(!serde_json::to_string(&p).unwrap().contains("view"));
}

/// Inconsistent views, missing sources and values a dtype cannot hold are one-line errors
/// naming the target tensor.
#[test]
fn bad_views_are_one_line_errors_naming_the_target() {
    let w = held("w", &table(12, 4, |_, _| 0), tp(2));
    let f32 = {
        let (mut l, f) = held("x", &table(12, 4, |_, _| 0), tp(1));
        l.dtype = reshard::layout::DType::F32;
        (l, f)
    };
    let err = |view: View, shape: &[u64]| -> String {
        let (dst, _) = layout("t", reshard::layout::DType::I16, shape, &tp(1), None);
        plan_views([("w", &w.0), ("x", &f32.0)], &[(dst, view)])
            .unwrap_err()
            .to_string()
    };
    let cases = [
        (View::source("nope"), vec![12, 4], "tensor `t`: is a view of `nope`, which the source does not hold"),
        (View::source("w").split(0, &[4, 2]), vec![4, 2, 4], "tensor `t`: splits dimension 0 of 12 into 4×2 (product 8)"),
        (View::source("w").slice(1, 2, 3), vec![12, 3], "tensor `t`: slice 2..5 of dimension 1 reaches past its 4 indices"),
        (View::source("w").slice(2, 0, 1), vec![12, 4], "tensor `t`: a slice of dimension 2, but its operand has shape [12, 4]"),
        (View::source("w").permute(&[0, 0]), vec![12, 4], "tensor `t`: permutes by [0, 0], not a permutation of the 2 dimensions of shape [12, 4]"),
        (View::source("w").merge(1, 2), vec![48], "tensor `t`: merges dimensions 1..3 of an operand of shape [12, 4]"),
        (View::concat(0, vec![View::source("w"), View::source("w").slice(1, 0, 2)]), vec![24, 4], "tensor `t`: concatenates along dimension 0 an operand of shape [12, 2] after operands of shape [12, 4]"),
        (View::concat(0, vec![]), vec![], "tensor `t`: concatenates no operands along dimension 0"),
        (View::source("w"), vec![4, 12], "tensor `t`: its view has shape [12, 4], the target [4, 12]"),
        (View::source("w").pad(0, 0, 1, 0.5), vec![13, 4], "tensor `t`: fill value 0.5 is not a value of I16"),
        (View::concat(0, vec![View::source("w"), View::source("x")]), vec![24, 4], "tensor `t`: is a view of `w` (I16) and `x` (F32): its sources must share one dtype"),
    ];
    for (view, shape, want) in cases {
        assert_eq!(err(view, &shape), want);
    }
}

/// Padded views run in parts (the plan split, each part's copies and fills clipped to its
/// spans and run on its own) write what one process writes, which is what ndarray computes:
/// a vocabulary padded past a whole file (a fill that part edges cut) and columns padded
/// (strided fills between strided copies), with values of one and of several bytes.
#[test]
fn padded_views_in_parts_write_what_one_process_writes() {
    let (vocab, padded, h, wide) = (1000u64, 2048u64, 64u64, 72u64);
    let real = table(vocab, h, |r, c| (r * 7 + c * 3) as u16 ^ 0x5a5a);
    let src = held("e", &real, tp(3));
    let value = |r, c| {
        if r < vocab && c < h {
            (r * 7 + c * 3) as u16 ^ 0x5a5a
        } else {
            0xff9c // -100
        }
    };
    let cases = [
        (
            View::source("e").pad(0, 0, padded - vocab, -100.0),
            table(padded, h, value),
            tp(2),
        ),
        (
            View::source("e").pad(1, 0, wide - h, -100.0),
            table(vocab, wide, value),
            tp(4),
        ),
        (
            View::source("e")
                .pad(0, 0, padded - vocab, -100.0)
                .pad(1, 0, wide - h, -100.0),
            table(padded, wide, value),
            tp(3),
        ),
    ];
    for (view, want, scheme) in cases {
        let (dst, expected) = held("e", &want, scheme);
        let p = check_plan(std::slice::from_ref(&src), &dst, &view, &expected).unwrap();
        assert!(p.bytes_filled() > 0);
        let whole = run(&p, &src.1, &sizes_of(&expected));
        assert!(whole == expected, "{view:?} in one process");
        for n in [2, 3, 5, 8] {
            let got = run_in_parts(&p, &src.1, &sizes_of(&expected), n);
            assert!(got == whole, "{view:?} in {n} parts");
        }
    }
}

/// The executor runs a plan's fills, and refuses malformed ones with one line naming the
/// output: rows that are not whole elements of the value, rows past the end of the file.
#[test]
fn the_executor_runs_fills_and_refuses_malformed_ones() {
    let real = table(3, 2, |r, c| (r * 2 + c) as u16);
    let src = held("e", &real, tp(1));
    let (dst, expected) = held(
        "e",
        &table(4, 2, |r, c| if r < 3 { (r * 2 + c) as u16 } else { 9 }),
        tp(1),
    );
    let p = plan_views(
        [("e", &src.0)],
        &[(dst, View::source("e").pad(0, 0, 1, 9.0))],
    )
    .unwrap();
    assert_eq!(p.fills.len(), 1);
    assert_eq!(run(&p, &src.1, &sizes_of(&expected)), expected);

    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("s");
    std::fs::write(&s, &src.1[0]).unwrap();
    let out = reshard::exec::OutputFile {
        path: "d".into(),
        size: expected[0].len() as u64,
        literals: vec![],
        checksums: vec![],
    };
    let opts = reshard::exec::ExecOptions {
        threads: Some(1),
        window: 64,
        progress: None,
        sync: false,
    };
    let err = |p: &Plan| {
        reshard::exec::execute(
            p,
            reshard::exec::Sources::local(std::slice::from_ref(&s)),
            std::slice::from_ref(&out),
            &[dir.path().join("d")],
            &opts,
        )
        .unwrap_err()
        .to_string()
    };
    std::fs::File::create(dir.path().join("d")).unwrap();
    let mut odd = p.clone();
    odd.fills[0].len += 1;
    assert_eq!(
        err(&odd),
        "d: a fill's rows of 5 bytes are not whole elements of 2 bytes"
    );
    let mut long = p.clone();
    long.fills[0].count = 2;
    long.fills[0].dst_stride = 4;
    assert_eq!(
        err(&long),
        "d: fill past the end of the output (2 rows of 4 bytes from 12, 4 apart; the output has 16)"
    );
}
