//! The trainer-side loader: every rank of several world sizes reads its own shards straight
//! from the files; the union over ranks is the whole tensor, and (checked through the OS
//! page cache) one rank reads about 1/M of the data, not all of it.

use crate::common::*;
use reshard::convert::Selection;
use reshard::formats::Checkpoint;
use reshard::layout::Region;
use reshard::load::local_shards;
use reshard::target::LayoutSpec;
use std::os::fd::AsRawFd;
use std::path::Path;

/// Bytes of `region` of a full row-major tensor.
fn slice(t: &Full, region: &Region) -> Vec<u8> {
    let e = elem(t.dtype);
    let n = t.shape.len();
    let mut out = vec![];
    if n == 0 {
        return t.data.clone();
    }
    let strides: Vec<usize> = (0..n).map(|d| t.shape[d + 1..].iter().product()).collect();
    let total: u64 = region.sizes[..n - 1].iter().product();
    for k in 0..total {
        // odometer over the outer dims
        let mut rem = k;
        let mut base = 0usize;
        for d in (0..n - 1).rev() {
            let i = rem % region.sizes[d];
            rem /= region.sizes[d];
            base += (region.offsets[d] + i) as usize * strides[d];
        }
        let a = (base + region.offsets[n - 1] as usize) * e;
        out.extend_from_slice(&t.data[a..a + region.sizes[n - 1] as usize * e]);
    }
    out
}

#[test]
fn every_rank_of_every_world_size_gets_exactly_its_shards() {
    for case in [
        "fsdp2_w4_f32",
        "fabric_fsdp1_w4_f32_torch21",
        "dtensor2d_w4",
        "hf_storage_w3_bf16",
    ] {
        let ck = Checkpoint::open(fixture(case).join("checkpoint")).unwrap();
        let oracle = read_safetensors(&fixture(case).join("oracle/full.safetensors"));
        for m in [1u64, 2, 3, 5, 8] {
            let mut covered: std::collections::BTreeMap<String, u64> = Default::default();
            for r in 0..m {
                let shards =
                    local_shards(&ck, &LayoutSpec::fsdp(m), r, &Selection::default(), None)
                        .unwrap();
                for s in shards {
                    let t = &oracle[&s.name];
                    assert_eq!(
                        s.data,
                        slice(t, &s.region),
                        "{case} M={m} r={r} {} {}",
                        s.name,
                        s.region
                    );
                    *covered.entry(s.name).or_default() += s.region.volume();
                }
            }
            for (name, t) in &oracle {
                // Shard(0) replicates scalars: every rank loads them whole
                let copies = if t.shape.is_empty() { m } else { 1 };
                let vol: u64 = t.shape.iter().product::<usize>() as u64 * copies;
                assert_eq!(
                    covered.get(name).copied().unwrap_or(0),
                    vol,
                    "{case} M={m}: {name} not covered exactly once"
                );
            }
        }
    }
}

/// Bytes of `path` resident in the page cache.
fn resident(path: &Path) -> u64 {
    let f = std::fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    if len == 0 {
        return 0;
    }
    // SAFETY: the map is only passed to mincore, never read; the file is this test's own.
    let m = unsafe { memmap2::Mmap::map(&f) }.unwrap();
    let pages = len.div_ceil(4096);
    let mut v = vec![0u8; pages];
    // SAFETY: `m` maps `len` bytes and `v` has one byte per page of them.
    let rc = unsafe { libc::mincore(m.as_ptr() as *mut libc::c_void, len, v.as_mut_ptr()) };
    assert_eq!(rc, 0);
    v.iter().filter(|&&b| b & 1 == 1).count() as u64 * 4096
}

fn evict(path: &Path) {
    let f = std::fs::File::open(path).unwrap();
    f.sync_all().unwrap();
    // SAFETY: a hint on an open descriptor; no memory is passed.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

#[test]
fn one_rank_reads_about_one_mth_of_the_data() {
    let d = tempfile::tempdir().unwrap();
    let ck = d.path().join("ck");
    // 8 tensors of 1024 x 1024 f32 (32 MiB), Shard(0) over 4 ranks
    let mut model = std::collections::BTreeMap::new();
    for i in 0..8 {
        let data: Vec<u8> = (0..1024 * 1024 * 4).map(|k| (k * 31 + i) as u8).collect();
        model.insert(
            format!("w{i}"),
            Full {
                dtype: safetensors::Dtype::F32,
                shape: vec![1024, 1024],
                data,
            },
        );
    }
    write_hf_storage(&ck, &fsdp_shards(&model, 4));
    let c = Checkpoint::open(&ck).unwrap();
    let total: u64 = 8 * 1024 * 1024 * 4;
    for m in [3u64, 8] {
        for f in &c.files {
            evict(f);
        }
        let before: u64 = c.files.iter().map(|f| resident(f)).sum();
        if before > total / 16 {
            eprintln!("skipped: this filesystem keeps evicted pages resident ({before} bytes), cannot measure");
            return;
        }
        let shards =
            local_shards(&c, &LayoutSpec::fsdp(m), 1, &Selection::default(), None).unwrap();
        let got: u64 = shards.iter().map(|s| s.data.len() as u64).sum();
        assert!(
            got >= total / m && got <= total / m + 8 * 4096 * 4,
            "M={m}: {got} bytes"
        );
        let after: u64 = c.files.iter().map(|f| resident(f)).sum();
        let read = after - before;
        // the rank's share, plus the kernel's fault-around (64 KiB) at the edges of each run
        assert!(read >= total / m, "M={m}: only {read} bytes resident");
        assert!(
            read <= total / m + 8 * 2 * 256 * 1024,
            "M={m}: rank 1 read {read} bytes of {total}, more than 1/{m}"
        );
        eprintln!("M={m}: rank 1 needed {got} bytes, page cache shows {read} read, of {total}");
    }
}

#[test]
fn caller_buffers_receive_the_same_bytes_and_a_wrong_size_is_refused() {
    use reshard::load::{local_regions, local_shards_into};
    let ck = Checkpoint::open(fixture("fsdp2_w4_f32").join("checkpoint")).unwrap();
    let layout = LayoutSpec::fsdp(3);
    let sel = Selection::default();
    for r in 0..3 {
        let shards = local_shards(&ck, &layout, r, &sel, None).unwrap();
        let regions = local_regions(&ck, &layout, r, &sel, None).unwrap();
        assert_eq!(regions.len(), shards.len());
        let mut bufs: Vec<Vec<u8>> = regions
            .iter()
            .map(|g| vec![0xAB; g.nbytes() as usize])
            .collect();
        let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        local_shards_into(&ck, &regions, &mut outs).unwrap();
        for (s, b) in shards.iter().zip(&bufs) {
            assert_eq!(&s.data, b, "rank {r} {}", s.name);
        }
        // one element short: refused, naming the tensor, nothing read
        let g = regions.iter().find(|g| g.nbytes() >= 4).unwrap();
        let mut short = vec![0u8; g.nbytes() as usize - 4];
        let e = local_shards_into(&ck, std::slice::from_ref(g), &mut [&mut short[..]])
            .unwrap_err()
            .to_string();
        assert!(e.contains(&g.name) && e.contains("the buffer"), "{e}");
    }
    // read_region_into: the same bytes as read_region, and the size is checked
    let t = &ck.tensors[0];
    let full = Region::full(&t.shape);
    let want = ck.read_region(&t.name, &full, None).unwrap();
    let mut got = vec![0u8; want.len()];
    ck.read_region_into(&t.name, &full, None, &mut got).unwrap();
    assert_eq!(got, want);
    let mut small = vec![0u8; want.len() - 1];
    assert!(ck
        .read_region_into(&t.name, &full, None, &mut small)
        .is_err());
}

/// Bytes of the local tensor whose dimension `d` holds global indices `idx[d]` (in order).
fn gather(t: &Full, idx: &[Vec<u64>]) -> Vec<u8> {
    let e = elem(t.dtype);
    let n = t.shape.len();
    let strides: Vec<usize> = (0..n).map(|d| t.shape[d + 1..].iter().product()).collect();
    let total: usize = idx.iter().map(Vec::len).product();
    let mut out = Vec::with_capacity(total * e);
    for k in 0..total {
        let mut rem = k;
        let mut at = 0usize;
        for d in (0..n).rev() {
            let i = rem % idx[d].len();
            rem /= idx[d].len();
            at += idx[d][i] as usize * strides[d];
        }
        out.extend_from_slice(&t.data[at * e..(at + 1) * e]);
    }
    out
}

#[test]
fn local_tensors_of_any_sharding_are_filled_in_place_with_their_parts_where_they_sit() {
    use reshard::layout::{Placement, Sharding};
    use reshard::load::{read_local_tensors_into, LocalTensor};
    let case = "fsdp2_w4_f32";
    let ck = Checkpoint::open(fixture(case).join("checkpoint")).unwrap();
    let oracle = read_safetensors(&fixture(case).join("oracle/full.safetensors"));
    let p = |s: &str| s.parse::<Placement>().unwrap();
    let shardings: Vec<Sharding> = [
        (vec![2, 2], vec!["StridedShard(0, 2)", "Shard(0)"]),
        (vec![2, 2], vec!["StridedShard(1, 2)", "Shard(1)"]),
        (vec![3, 2], vec!["Shard(1)", "Shard(0)"]),
        (vec![2, 2], vec!["Shard(1)", "StridedShard(1, 2)"]),
        (vec![2], vec!["Replicate"]),
        (vec![5], vec!["Shard(0)"]),
        (vec![7], vec!["Shard(1)"]),
    ]
    .into_iter()
    .map(|(mesh, pl)| Sharding {
        mesh: reshard::layout::Mesh(mesh),
        placements: pl.into_iter().map(p).collect(),
    })
    .collect();
    let mut interleaved = 0;
    for sh in &shardings {
        for rank in 0..sh.mesh.world() {
            let coord = sh.mesh.coords(rank);
            let mut lts = vec![];
            for t in ck.tensors.iter().filter(|t| t.shape.len() == 2) {
                lts.push(LocalTensor::of_sharding(&t.name, t.dtype, &t.shape, sh, &coord).unwrap());
            }
            let mut bufs: Vec<Vec<u8>> = lts
                .iter()
                .map(|l| vec![0xAA; l.nbytes() as usize])
                .collect();
            let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            read_local_tensors_into(&ck, &lts, &mut outs).unwrap();
            for (lt, got) in lts.iter().zip(&bufs) {
                let segs = sh.rank_segments(
                    &oracle[&lt.name]
                        .shape
                        .iter()
                        .map(|&d| d as u64)
                        .collect::<Vec<_>>(),
                    rank,
                );
                if segs
                    .iter()
                    .skip(1)
                    .any(|d| d.iter().filter(|s| s.1 > 0).count() > 1)
                {
                    interleaved += 1;
                }
                let idx: Vec<Vec<u64>> = segs
                    .iter()
                    .map(|d| d.iter().flat_map(|&(a, n)| a..a + n).collect())
                    .collect();
                let want = gather(&oracle[&lt.name], &idx);
                assert_eq!(
                    got, &want,
                    "{} under {:?} at {coord:?}",
                    lt.name, sh.placements
                );
            }
        }
    }
    assert!(
        interleaved > 0,
        "a part interleaved along dim 1 was exercised"
    );
    // A buffer of the wrong size, a coordinate off the mesh and a region outside the tensor
    // are refused before anything is read.
    let t = &ck.tensors[0];
    let lt = LocalTensor::whole(&t.name, t.dtype, &t.shape);
    let mut short = vec![0u8; lt.nbytes() as usize - 1];
    let err = read_local_tensors_into(&ck, &[lt], &mut [short.as_mut_slice()]).unwrap_err();
    assert!(err.to_string().contains("bytes, the buffer"), "{err}");
    let sh = Sharding::fsdp(2);
    let err = LocalTensor::of_sharding(&t.name, t.dtype, &t.shape, &sh, &[2]).unwrap_err();
    assert!(err.to_string().contains("outside the mesh"), "{err}");
    let mut big = t.shape.clone();
    big[0] += 1;
    let lt = LocalTensor::whole(&t.name, t.dtype, &big);
    let mut buf = vec![0u8; lt.nbytes() as usize];
    let err = read_local_tensors_into(&ck, &[lt], &mut [buf.as_mut_slice()]).unwrap_err();
    assert!(err.to_string().contains("outside the shape"), "{err}");
}

#[test]
fn large_local_tensors_are_cut_into_parallel_copies_and_cast_exactly() {
    use reshard::layout::{DType, Sharding};
    use reshard::load::{read_local_tensors_into, LocalTensor};
    // 1500 x 2048 f32 = 12 MiB: several parallel tasks per copy.
    let shape = vec![1500usize, 2048];
    let vals: Vec<f32> = (0..shape[0] * shape[1])
        .map(|i| (i as f32) * 0.25 - 7.0)
        .collect();
    let data: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.safetensors");
    let full = Full {
        dtype: safetensors::Dtype::F32,
        shape: shape.clone(),
        data,
    };
    write_safetensors(&path, &[("w".to_string(), full)].into_iter().collect());
    let ck = Checkpoint::open(&path).unwrap();
    let oracle = read_safetensors(&path);
    let g: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    for (sh, coord) in [(Sharding::fsdp(1), vec![0]), (Sharding::fsdp(3), vec![1])] {
        let lt = LocalTensor::of_sharding("w", DType::F32, &g, &sh, &coord).unwrap();
        let mut buf = vec![0u8; lt.nbytes() as usize];
        read_local_tensors_into(&ck, std::slice::from_ref(&lt), &mut [buf.as_mut_slice()]).unwrap();
        let r = &lt.parts[0].region;
        assert_eq!(buf, slice(&oracle["w"], r));
        // The same as bf16: every element converted (round to nearest even).
        let lt16 = LocalTensor {
            dtype: DType::BF16,
            ..lt.clone()
        };
        let mut b16 = vec![0u8; lt16.nbytes() as usize];
        read_local_tensors_into(&ck, &[lt16], &mut [b16.as_mut_slice()]).unwrap();
        let want: Vec<u8> = buf
            .chunks(4)
            .flat_map(|c| {
                half::bf16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes()
            })
            .collect();
        assert_eq!(b16, want);
    }
    // A column block (strided rows, 1500 rows of 4 KiB) lands where it belongs.
    let sh = Sharding {
        mesh: reshard::layout::Mesh(vec![2]),
        placements: vec!["Shard(1)".parse().unwrap()],
    };
    let lt = LocalTensor::of_sharding("w", DType::F32, &g, &sh, &[1]).unwrap();
    let mut buf = vec![0u8; lt.nbytes() as usize];
    read_local_tensors_into(&ck, std::slice::from_ref(&lt), &mut [buf.as_mut_slice()]).unwrap();
    assert_eq!(buf, slice(&oracle["w"], &lt.parts[0].region));
}

/// The DCP fixtures (torch's own checkpoints of every kind the reader knows).
fn dcp_fixtures() -> Vec<std::path::PathBuf> {
    fixture_checkpoints()
        .into_iter()
        .filter(|p| Checkpoint::open(p).unwrap().format == reshard::formats::Format::DCP)
        .collect()
}

#[test]
fn a_lazily_opened_checkpoint_reads_the_same_bytes_as_an_eagerly_opened_one() {
    let dirs = dcp_fixtures();
    assert!(dirs.len() >= 8, "{dirs:?}");
    let sel = Selection::default();
    let mut pending = 0;
    for dir in &dirs {
        let eager = Checkpoint::open(dir).unwrap();
        let lazy = Checkpoint::open_lazy(dir, None).unwrap();
        // The same data files (a zstd checkpoint's decoded scratch file is one of each's own).
        let n = eager.files.len() - eager.scratch.len();
        assert_eq!(lazy.files.len(), eager.files.len(), "{}", dir.display());
        assert_eq!(lazy.files[..n], eager.files[..n], "{}", dir.display());
        assert_eq!(lazy.extras.len(), eager.extras.len());
        assert_eq!(lazy.tensors.len(), eager.tensors.len());
        for (a, b) in lazy.tensors.iter().zip(&eager.tensors) {
            assert_eq!((&a.name, a.dtype, &a.shape), (&b.name, b.dtype, &b.shape));
            let regions = |t: &reshard::layout::TensorLayout| {
                t.pieces
                    .iter()
                    .map(|p| (p.rank, p.region.clone()))
                    .collect::<Vec<_>>()
            };
            assert_eq!(regions(a), regions(b), "{} {}", dir.display(), a.name);
            pending += a.pieces.iter().filter(|p| p.loc.pending.is_some()).count();
            assert!(b.pieces.iter().all(|p| p.loc.pending.is_none()));
            let full = Region::full(&a.shape);
            assert_eq!(
                lazy.read_region(&a.name, &full, None).unwrap(),
                eager.read_region(&b.name, &full, None).unwrap(),
                "{} {}",
                dir.display(),
                a.name
            );
        }
        for m in [1u64, 3] {
            for r in 0..m {
                let layout = LayoutSpec::fsdp(m);
                assert_eq!(
                    local_shards(&lazy, &layout, r, &sel, None).unwrap(),
                    local_shards(&eager, &layout, r, &sel, None).unwrap(),
                    "{} M={m} r={r}",
                    dir.display()
                );
            }
        }
        assert_eq!(lazy.tied_names().unwrap(), eager.tied_names().unwrap());
        // A plan needs located pieces: one from a lazy checkpoint is refused, not made wrong.
        let e = reshard::plan::plan(&lazy.tensors, &eager.tensors);
        if lazy
            .tensors
            .iter()
            .any(|t| t.pieces.iter().any(|p| p.loc.pending.is_some()))
        {
            let e = e.unwrap_err().to_string();
            assert!(e.contains("not yet located"), "{e}");
        }
    }
    assert!(pending > 100, "only {pending} pieces were left pending");
}

#[test]
fn a_rank_reads_only_the_item_headers_of_its_own_chunks() {
    let d = tempfile::tempdir().unwrap();
    let dir = copy_fixture("fsdp2_w4_f32", d.path());
    // Break the zip header of one item of rank 3: where the lazy pieces point.
    let lazy = Checkpoint::open_lazy(&dir, None).unwrap();
    let (t, p) = lazy
        .tensors
        .iter()
        .find_map(|t| {
            Some((
                t,
                t.pieces
                    .iter()
                    .find(|p| p.rank == 3 && p.region.volume() > 0)?,
            ))
        })
        .unwrap();
    assert!(p.loc.pending.is_some());
    let file = lazy.files[p.loc.file as usize].clone();
    let mut bytes = std::fs::read(&file).unwrap();
    assert_eq!(&bytes[p.loc.offset as usize..][..4], b"PK\x03\x04");
    bytes[p.loc.offset as usize] = b'X';
    std::fs::write(&file, bytes).unwrap();
    // An eager open parses every item and refuses the checkpoint, naming the file.
    let eager = Checkpoint::open(&dir).unwrap_err().to_string();
    assert!(eager.starts_with(&file.display().to_string()), "{eager}");
    assert!(
        eager.contains(&format!("item `{}` at offset {}", t.name, p.loc.offset)),
        "{eager}"
    );
    // Lazily, the ranks of the source's own layout that do not need that item load; the
    // one that does gets the eager open's message.
    let lazy = Checkpoint::open_lazy(&dir, None).unwrap();
    let layout = LayoutSpec::fsdp(4);
    let sel = Selection::default();
    let clean = Checkpoint::open(fixture("fsdp2_w4_f32").join("checkpoint")).unwrap();
    for r in 0..3 {
        assert_eq!(
            local_shards(&lazy, &layout, r, &sel, None).unwrap(),
            local_shards(&clean, &layout, r, &sel, None).unwrap(),
            "rank {r}"
        );
    }
    let e = local_shards(&lazy, &layout, 3, &sel, None)
        .unwrap_err()
        .to_string();
    assert_eq!(e, eager);
}

#[test]
fn a_data_file_shortened_after_a_lazy_open_is_an_error_not_a_fault() {
    let d = tempfile::tempdir().unwrap();
    let dir = copy_fixture("fsdp2_w4_f32", d.path());
    let lazy = Checkpoint::open_lazy(&dir, None).unwrap();
    let file = dir.join("__1_0.distcp");
    let len = std::fs::metadata(&file).unwrap().len();
    set_len(&file, len / 2);
    let e = local_shards(&lazy, &LayoutSpec::fsdp(4), 1, &Selection::default(), None)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(&file.display().to_string()) && e.contains("is truncated"),
        "{e}"
    );
}
