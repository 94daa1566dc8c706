//! A `torch.save` file (`.pt`) holding a consolidated state dict that
//! `torch.load(path, weights_only=True)` opens: the nested dict the flat keys describe
//! (DCP `planner_data`), non-tensor values restored as Python values, Lightning's `meta.pt`
//! keys merged at the top level as `fabric consolidate` does. Tensor data records are laid out
//! (64-byte aligned, as torch aligns them) before any data exists, filled in place by the
//! executor, which computes their CRC-32s as the bytes stream. Tied tensors
//! ([`WriteOptions::ties`]) share one storage record, as `torch.save` of a tied model does;
//! only the first of a group is in the output's tensor list, so its bytes are copied once.

use crate::error::{Error, Result};
use crate::layout::{Region, TensorLayout};
use crate::torch::pickle::extra_value;
use crate::torch::pickle::{pickle, PyValue};
use crate::torch::save::{standard_records, TensorRef};
use crate::torch::zip::{layout_archive, output_parts};
use crate::{KeyPart, Output, TargetTensor, WriteOptions};
use reshard_core::output::OutputFile;
use std::collections::HashMap;
use std::path::PathBuf;

/// A node of the state dict being rebuilt.
enum Node {
    /// A tensor (index into the target list) or a Python value.
    Tensor(usize),
    Value(PyValue),
    /// A dict, keyed by [`KeyPart::Key`] or [`KeyPart::IntKey`], in insertion order, with
    /// an index of its keys.
    Map(Vec<(KeyPart, Node)>, HashMap<KeyPart, usize>),
    Seq(Vec<(i64, Node)>, HashMap<i64, usize>),
}

fn container_for(next: &KeyPart) -> Node {
    match next {
        KeyPart::Key(_) | KeyPart::IntKey { .. } => Node::Map(vec![], HashMap::new()),
        KeyPart::Index(_) => Node::Seq(vec![], HashMap::new()),
    }
}

/// Put `leaf` at `path` under `node`.
fn insert(node: &mut Node, path: &[KeyPart], leaf: Node, name: &str) -> Result<()> {
    let clash = || {
        Error::usage(format!(
            "`{name}`: its place in the nested state dict is taken by another key"
        ))
    };
    let Some((first, rest)) = path.split_first() else {
        return Err(clash());
    };
    let slot: &mut Node = match (node, first) {
        (Node::Map(items, index), k @ (KeyPart::Key(_) | KeyPart::IntKey { .. })) => {
            match index.get(k) {
                Some(&i) => &mut items[i].1,
                None => {
                    let fresh = match rest.first() {
                        None => {
                            index.insert(k.clone(), items.len());
                            items.push((k.clone(), leaf));
                            return Ok(());
                        }
                        Some(next) => container_for(next),
                    };
                    index.insert(k.clone(), items.len());
                    items.push((k.clone(), fresh));
                    &mut items.last_mut().expect("just pushed").1
                }
            }
        }
        (Node::Seq(items, index), KeyPart::Index(i)) => match index.get(i) {
            Some(&p) => &mut items[p].1,
            None => {
                let fresh = match rest.first() {
                    None => {
                        index.insert(*i, items.len());
                        items.push((*i, leaf));
                        return Ok(());
                    }
                    Some(next) => container_for(next),
                };
                index.insert(*i, items.len());
                items.push((*i, fresh));
                &mut items.last_mut().expect("just pushed").1
            }
        },
        _ => return Err(clash()),
    };
    if rest.is_empty() {
        return Err(clash());
    }
    insert(slot, rest, leaf, name)
}

/// Storage keys handed out while pickling: tensors in pickle order, tied tensors sharing the
/// key of the first of their group.
struct Storages<'a> {
    /// Target index of each storage, in key order.
    order: Vec<usize>,
    /// Tie group of a target index.
    group: &'a [Option<usize>],
    /// Storage key of each tie group, once given.
    keys: Vec<Option<usize>>,
}

/// Turn the tree into a Python value.
fn to_py(node: Node, target: &[TargetTensor], st: &mut Storages) -> Result<PyValue> {
    Ok(match node {
        Node::Tensor(i) => {
            let shared = st.group[i].and_then(|g| st.keys[g]);
            let k = shared.unwrap_or_else(|| {
                st.order.push(i);
                st.order.len() - 1
            });
            if let Some(g) = st.group[i] {
                st.keys[g] = Some(k);
            }
            PyValue::Tensor(TensorRef::new(
                k.to_string(),
                target[i].dtype,
                target[i].shape.clone(),
            ))
        }
        Node::Value(v) => v,
        Node::Map(items, _) => PyValue::Dict(
            items
                .into_iter()
                .map(|(k, n)| {
                    let key = match k {
                        KeyPart::IntKey { int } => PyValue::Int(int),
                        k => PyValue::Str(k.text()),
                    };
                    Ok((key, to_py(n, target, st)?))
                })
                .collect::<Result<_>>()?,
        ),
        Node::Seq(mut items, _) => {
            items.sort_by_key(|(i, _)| *i);
            if items.iter().enumerate().any(|(k, (i, _))| *i != k as i64) {
                return Err(Error::usage("a list in the state dict has missing indices"));
            }
            PyValue::List(
                items
                    .into_iter()
                    .map(|(_, n)| to_py(n, target, st))
                    .collect::<Result<_>>()?,
            )
        }
    })
}

/// The non-tensor entries `extras` as the items of a dict, nested as `paths` says (names
/// absent there are top-level keys), as [`write`] nests them.
pub(crate) fn nested_values(
    extras: &[&crate::Extra],
    paths: &std::collections::BTreeMap<String, Vec<KeyPart>>,
) -> Result<Vec<(PyValue, PyValue)>> {
    let mut root = Node::Map(vec![], HashMap::new());
    for e in extras {
        let path = paths
            .get(&e.name)
            .cloned()
            .unwrap_or_else(|| vec![KeyPart::Key(e.name.clone())]);
        insert(&mut root, &path, Node::Value(extra_value(e)), &e.name)?;
    }
    let mut st = Storages {
        order: vec![],
        group: &[],
        keys: vec![],
    };
    match to_py(root, &[], &mut st)? {
        PyValue::Dict(items) => Ok(items),
        _ => Err(Error::internal("nested values: not a dict")),
    }
}

/// Lay out a consolidated target (and the non-tensor entries of `opts`) as one `.pt` file.
pub fn write(target: &[TargetTensor], opts: &WriteOptions) -> Result<Output> {
    let path_of = |name: &str| -> Vec<KeyPart> {
        opts.paths
            .get(name)
            .cloned()
            .unwrap_or_else(|| vec![KeyPart::Key(name.to_string())])
    };
    let mut root = Node::Map(vec![], HashMap::new());
    for (i, t) in target.iter().enumerate() {
        insert(&mut root, &path_of(&t.name), Node::Tensor(i), &t.name)?;
    }
    for e in &opts.extras {
        insert(
            &mut root,
            &path_of(&e.name),
            Node::Value(extra_value(e)),
            &e.name,
        )?;
    }
    let mut group = vec![None; target.len()];
    for (g, names) in opts.ties.iter().enumerate() {
        for n in names {
            if let Some(i) = target.iter().position(|t| &t.name == n) {
                group[i] = Some(g);
            }
        }
    }
    let mut st = Storages {
        order: vec![],
        group: &group,
        keys: vec![None; opts.ties.len()],
    };
    let value = to_py(root, target, &mut st)?;
    let order = st.order;
    let storages: Vec<(String, u64)> = order
        .iter()
        .enumerate()
        .map(|(k, &i)| {
            (
                k.to_string(),
                Region::full(&target[i].shape).volume() * target[i].dtype.size() as u64,
            )
        })
        .collect();
    let records = standard_records(pickle(&value), &storages);
    let layout = layout_archive("archive", &records);
    let (literals, checksums) = output_parts(&layout, &records, 0);
    let mut tensors = vec![];
    for (k, &i) in order.iter().enumerate() {
        let name = format!("data/{k}");
        let r = records
            .iter()
            .position(|r| r.name == name)
            .ok_or_else(|| Error::usage(format!("internal error: no record {name}")))?;
        let t = &target[i];
        tensors.push(TensorLayout::whole(
            t.name.clone(),
            t.dtype,
            t.shape.clone(),
            0,
            layout.data_offsets[r],
            None,
        ));
    }
    let file = OutputFile {
        path: PathBuf::from("model.pt"),
        size: layout.len,
        literals,
        checksums,
    };
    Ok(Output {
        files: vec![file],
        tensors,
        copies: vec![],
    })
}
