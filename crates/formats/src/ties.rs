//! Tied tensors: two or more names holding the same dtype, shape and bytes — a tied input
//! embedding and LM head, saved twice by DCP (one item per key) or once by `torch.save`
//! (one storage). Writers that can alias (`.pt`) store a tied group once; safetensors forbids
//! aliasing, so there every name keeps its copy and `inspect` says which names are tied.
//!
//! Finding them reads little: tensors are grouped by dtype and shape, names whose pieces
//! point at the same bytes are tied outright, and the rest are compared by a probe of their
//! first 64 KiB before a full comparison in 8 MiB blocks. Tensors whose probe is one repeated
//! value (zeros, ones: fresh biases, norms, optimizer moments at step 0) are equal by
//! coincidence, not tied, and are left alone unless they share storage.

use crate::error::Result;
use crate::layout::{Region, TensorLayout};
use crate::read::read_regions;
use reshard_storage::Sources;
use std::collections::HashMap;

/// Bytes read from each candidate before any full comparison.
const PROBE: u64 = 64 << 10;
/// Bytes per block of a full comparison.
const BLOCK: u64 = 8 << 20;
/// Probes read at once (at most 16 MiB in memory).
const PROBE_BATCH: usize = 256;

/// Read `want` (tensor, region) of `files`, each in its tensor's dtype, in one mapping.
fn read(files: Sources, want: &[(&TensorLayout, Region)]) -> Result<Vec<Vec<u8>>> {
    let want: Vec<_> = want.iter().map(|(t, r)| (*t, r, t.dtype)).collect();
    read_regions(files, &want)
}

/// True when `bytes` is one element value repeated.
fn constant(bytes: &[u8], elem: usize) -> bool {
    bytes.len() >= elem && bytes.chunks_exact(elem).all(|c| c == &bytes[..elem])
}

/// Whether tensors `a` and `b` (same dtype and shape) hold the same bytes.
fn equal(files: Sources, a: &TensorLayout, b: &TensorLayout) -> Result<bool> {
    for r in Region::row_blocks(&a.shape, a.dtype.size() as u64, BLOCK) {
        let got = read(files, &[(a, r.clone()), (b, r)])?;
        if got[0] != got[1] {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The tensors that can be tied: groups (sorted) of two or more non-empty tensors of one
/// dtype and shape, as indices into `tensors`, ascending. Only they are ever read.
fn candidates<T: std::borrow::Borrow<TensorLayout>>(tensors: &[T]) -> Vec<Vec<usize>> {
    let mut by_kind: HashMap<(crate::layout::DType, &[u64]), Vec<usize>> = HashMap::new();
    for (i, t) in tensors.iter().enumerate() {
        let t = t.borrow();
        if t.nbytes() > 0 {
            by_kind
                .entry((t.dtype, t.shape.as_slice()))
                .or_default()
                .push(i);
        }
    }
    let mut kinds: Vec<Vec<usize>> = by_kind.into_values().filter(|v| v.len() > 1).collect();
    kinds.sort();
    kinds
}

/// Groups (two or more, as indices into `tensors`, ascending) of tied tensors among
/// `tensors`, whose pieces lie in `files`.
pub fn find(files: Sources, tensors: &[&TensorLayout]) -> Result<Vec<Vec<usize>>> {
    let mut groups: Vec<Vec<usize>> = vec![];
    for members in candidates(tensors) {
        let aliased = aliased(tensors, &members);
        let mut merged: Vec<Option<Vec<usize>>> = aliased.iter().cloned().map(Some).collect();
        for cands in probe_buckets(files, tensors, &aliased)? {
            merge_equal(files, tensors, &aliased, &cands, &mut merged)?;
        }
        groups.extend(merged.into_iter().flatten().filter(|g| g.len() > 1));
    }
    for g in &mut groups {
        g.sort_unstable();
    }
    groups.sort();
    Ok(groups)
}

/// `members` (of one dtype and shape) grouped by the bytes they read: names over the very
/// same bytes (a torch.save storage shared by two keys) share a group. In order of first
/// member.
fn aliased(tensors: &[&TensorLayout], members: &[usize]) -> Vec<Vec<usize>> {
    let mut aliased: Vec<Vec<usize>> = vec![];
    let mut by_bytes: HashMap<Vec<BytesKey>, usize> = HashMap::new();
    for &i in members {
        match by_bytes.entry(bytes_key(tensors[i])) {
            std::collections::hash_map::Entry::Occupied(g) => aliased[*g.get()].push(i),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(aliased.len());
                aliased.push(vec![i]);
            }
        }
    }
    aliased
}

/// Probe one representative of each group of `aliased` (in batches, keeping only a hash of
/// each probe, so memory stays bounded) and bucket the groups whose probes are equal and not
/// constant: the candidates for a full comparison, as indices into `aliased`, bucket by
/// bucket in order of first member.
fn probe_buckets(
    files: Sources,
    tensors: &[&TensorLayout],
    aliased: &[Vec<usize>],
) -> Result<Vec<Vec<usize>>> {
    let mut buckets: HashMap<u64, Vec<usize>> = HashMap::new();
    let mut order = vec![];
    for batch in (0..aliased.len()).collect::<Vec<_>>().chunks(PROBE_BATCH) {
        let probes = read(
            files,
            &batch
                .iter()
                .map(|&k| {
                    let t = tensors[aliased[k][0]];
                    let first =
                        Region::row_blocks(&t.shape, t.dtype.size() as u64, PROBE).swap_remove(0);
                    (t, first)
                })
                .collect::<Vec<_>>(),
        )?;
        for (&k, p) in batch.iter().zip(&probes) {
            if constant(p, tensors[aliased[k][0]].dtype.size()) {
                continue;
            }
            let mut h = std::collections::hash_map::DefaultHasher::new();
            std::hash::Hash::hash(p, &mut h);
            let b = buckets.entry(std::hash::Hasher::finish(&h)).or_default();
            if b.is_empty() {
                order.push(std::hash::Hasher::finish(&h));
            }
            b.push(k);
        }
    }
    Ok(order
        .into_iter()
        .filter_map(|key| buckets.remove(&key))
        .collect())
}

/// Compare the candidates `cands` (indices into `aliased`, equal probes) in full and move
/// each group of `merged` into the first earlier candidate it equals.
fn merge_equal(
    files: Sources,
    tensors: &[&TensorLayout],
    aliased: &[Vec<usize>],
    cands: &[usize],
    merged: &mut [Option<Vec<usize>>],
) -> Result<()> {
    let mut classes: Vec<usize> = vec![];
    for &k in cands {
        let t = tensors[aliased[k][0]];
        let mut home = None;
        for &c in &classes {
            if equal(files, tensors[aliased[c][0]], t)? {
                home = Some(c);
                break;
            }
        }
        match home {
            Some(c) => {
                let moved = merged[k].take().unwrap_or_default();
                if let Some(g) = merged[c].as_mut() {
                    g.extend(moved);
                }
            }
            None => classes.push(k),
        }
    }
    Ok(())
}

/// Where one piece's elements are read from: region offsets and sizes, file, offset, strides.
type BytesKey = (Vec<u64>, Vec<u64>, u32, u64, Option<Vec<u64>>);

/// Two layouts (of one dtype and shape) with equal keys read every element from the same
/// place.
fn bytes_key(t: &TensorLayout) -> Vec<BytesKey> {
    t.pieces
        .iter()
        .map(|p| {
            (
                p.region.offsets.to_vec(),
                p.region.sizes.to_vec(),
                p.loc.file,
                p.loc.offset,
                p.loc.strides.clone(),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DType, Loc, Piece};

    fn whole(name: &str, shape: &[u64], offset: u64) -> TensorLayout {
        TensorLayout {
            name: name.into(),
            dtype: DType::F32,
            shape: shape.to_vec(),
            pieces: vec![Piece {
                rank: 0,
                region: Region::full(shape),
                loc: Loc {
                    file: 0,
                    offset,
                    strides: None,
                    pending: None,
                },
            }],
        }
    }

    #[test]
    fn equal_bytes_are_tied_constants_only_when_shared() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("data");
        // a: 0..40000 pattern, b: the same at another offset, c: differs in the last byte,
        // z1/z2: zeros (equal by coincidence), z3: shares z1's bytes
        let n = 100_000u64; // 400 kB per tensor: probe + several blocks
        let pat: Vec<u8> = (0..n * 4).map(|i| (i * 31 % 253) as u8).collect();
        let mut c = pat.clone();
        *c.last_mut().unwrap() ^= 1;
        let zeros = vec![0u8; (n * 4) as usize];
        let bytes = [pat.clone(), pat, c, zeros.clone(), zeros].concat();
        std::fs::write(&f, &bytes).unwrap();
        let sh = [n / 10, 10];
        let t = [
            whole("a", &sh, 0),
            whole("b", &sh, n * 4),
            whole("c", &sh, 2 * n * 4),
            whole("z1", &sh, 3 * n * 4),
            whole("z2", &sh, 4 * n * 4),
            whole("z3", &sh, 3 * n * 4),
            whole("other_shape", &[n], 0),
        ];
        let refs: Vec<&TensorLayout> = t.iter().collect();
        let g = find(Sources::local(std::slice::from_ref(&f)), &refs).unwrap();
        assert_eq!(g, vec![vec![0, 1], vec![3, 5]]);
    }
}

/// Groups of tied tensors of `ck` by name: each group two or more names in checkpoint order,
/// the groups in the order [`find`] gives them.
pub fn tied_names(ck: &crate::Checkpoint) -> Result<Vec<Vec<String>>> {
    // Only the candidates are read: of a lazily opened checkpoint, only their pieces are
    // located.
    let mut read = vec![false; ck.tensors.len()];
    for i in candidates(&ck.tensors).into_iter().flatten() {
        read[i] = true;
    }
    let none: Option<&[&Region]> = Some(&[]);
    let want: Vec<_> = ck
        .tensors
        .iter()
        .zip(&read)
        .map(|(t, &r)| (t, if r { None } else { none }))
        .collect();
    let located = ck.located_many(&want)?;
    let all: Vec<&TensorLayout> = located.iter().map(|t| &**t).collect();
    Ok(find(ck.sources(), &all)?
        .into_iter()
        .map(|g| g.into_iter().map(|i| all[i].name.clone()).collect())
        .collect())
}

#[cfg(test)]
mod tied_names_tests {
    use super::tied_names;
    use crate::Checkpoint;

    #[test]
    fn names_tied_tensors_of_an_opened_checkpoint() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("m.safetensors");
        let values: Vec<u8> = (0..16u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let mut other = values.clone();
        other[0] ^= 1;
        let header = serde_json::json!({
            "a": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]},
            "b": {"dtype": "F32", "shape": [4, 4], "data_offsets": [64, 128]},
            "c": {"dtype": "F32", "shape": [4, 4], "data_offsets": [128, 192]},
        })
        .to_string();
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header.as_bytes());
        file.extend_from_slice(&[values.clone(), values, other].concat());
        std::fs::write(&path, file).unwrap();
        let ck = Checkpoint::open(&path).unwrap();
        assert_eq!(tied_names(&ck).unwrap(), vec![vec!["a", "b"]]);
    }
}
