//! Reading one `torch.save` file (`.pt`, the zip format torch >= 1.6 writes by default) as a
//! single-rank checkpoint. This module owns the walk from the decoded `data.pkl` to flat
//! keys; the zip container, the pickle and the tensor rebuild calls are [`crate::torch`]'s.
//!
//! The file is memory-mapped; only its central directory, the local headers of the records
//! used and `data.pkl` are read, never tensor data. The unpickled value must be a dict (a
//! state dict); it is flattened exactly as torch DCP's `flatten_state_dict` does
//! (`torch/distributed/checkpoint/_traverse.py`): dicts are always traversed (their keys
//! named by `str(key)`), lists only when they hold a tensor or a non-terminal dict or list,
//! everything else is a leaf; flat keys are the path parts joined with `.` (so an empty dict
//! leaves no key, and int dict keys become str path parts, as in DCP). The `_metadata`
//! attribute of `nn.Module.state_dict()` is not a key (`is_module_metadata`). A key's path
//! is kept in [`Checkpoint::paths`] when it is not just `[Key(name)]`, so the `.pt` writer
//! rebuilds the same nesting. Tensor leaves point at element 0 of their view inside their
//! storage record (strides kept when not row-major; tied weights share one record); other
//! leaves become [`Extra`]s with their pickle.
//!
//! Refused, with one line naming the file: the legacy (pre-1.6, non-zip) format, damaged zips
//! and pickles, missing or short storage records, a top level that is not a dict, tensors
//! inside tuples, sets or other objects, tensor subclasses, duplicate flat keys.

use crate::error::{Error, IoContext, Result};
use crate::layout::TensorLayout;
use crate::torch::pickle::Value;
use crate::torch::save::{self, TensorItem};
use crate::torch::short;
use crate::torch::zip::Archive;
use crate::{dcp, Checkpoint, Extra, Format, KeyPart, RecordCrc};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

/// The start of a legacy `torch.save` file: protocol 2, then `LONG1` of the magic number
/// `0x1950a86a20f9469cfc6c`.
const LEGACY_MAGIC: &[u8] = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19";

/// True when `head` (the first bytes of a file) starts a legacy, pre-1.6 `torch.save` file.
pub fn is_legacy(head: &[u8]) -> bool {
    head.starts_with(LEGACY_MAGIC)
}

/// Read the `torch.save` zip file at `path` as a one-rank checkpoint of its flattened state
/// dict.
pub fn read(path: &Path) -> Result<Checkpoint> {
    read_with(path, None)
}

/// [`read`] with another allow-list of globals than `torch.save`'s (`None`: that one), for
/// files of a trainer that pickles its own values beside the state dict (Megatron-LM's
/// `argparse.Namespace` of arguments, its RNG states).
pub fn read_with(
    path: &Path,
    globals: Option<&crate::torch::pickle::Globals>,
) -> Result<Checkpoint> {
    let f = std::fs::File::open(path).at(path)?;
    let len = f.metadata().at(path)?.len();
    if len == 0 {
        return Err(Error::format(path, "is empty, not a torch.save file"));
    }
    let map = crate::sys::map_file(&f, path)?;
    decode(path, &map, globals)
}

/// Read the `torch.save` file `bytes` (the content of `path`), its pickle under `globals`
/// (`None`: `torch.save`'s allow-list).
fn decode(
    path: &Path,
    bytes: &[u8],
    globals: Option<&crate::torch::pickle::Globals>,
) -> Result<Checkpoint> {
    if is_legacy(bytes) {
        return Err(Error::format(
            path,
            "uses the legacy torch.save format; re-save with torch>=1.6 default \
             (zip) serialization: torch.save(torch.load(f), f2)",
        ));
    }
    let item = match globals {
        Some(g) => save::parse_with(bytes, g),
        None => save::parse(bytes),
    }
    .map_err(|e| Error::format(path, e.to_string()))?;
    if item.tensor.is_some() || is_tensor_call(&item.value) {
        return Err(Error::format(
            path,
            "holds a single tensor, not a state dict: save a dict such as {\"weight\": t}",
        ));
    }
    let Value::Dict(pairs) = &item.value else {
        return Err(Error::format(
            path,
            format!(
                "holds a pickled {}, not a state dict (a dict)",
                item.value.kind()
            ),
        ));
    };
    let mut w = Walker::new(path, &item.archive, bytes);
    w.dict(&mut vec![], pairs)?;
    let version = item
        .archive
        .read(bytes, &format!("{}/version", item.archive.prefix))
        .ok()
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty() && v.len() <= 8 && v.bytes().all(|b| b.is_ascii_digit()));
    let producer = match version {
        _ if save::written_by_reshard(&item.archive, bytes) => {
            "reshard (a torch.save zip archive)".to_string()
        }
        Some(v) => format!("torch.save (zip, archive version {v})"),
        None => "torch.save (zip)".to_string(),
    };
    Ok(Checkpoint {
        format: Format::PT,
        path: path.to_path_buf(),
        files: vec![path.to_path_buf()],
        side_files: vec![],
        ranks: 1,
        tensors: w.tensors,
        metadata: BTreeMap::new(),
        extras: w.extras,
        paths: w.paths,
        producer: Some(producer),
        saved: None,
        tag: None,
        companions: vec![],
        scratch: vec![],
        checksums: w.checksums,
        locator: None,
        storage: reshard_storage::local(),
    })
}

/// True for the calls `torch.save` pickles a tensor as (plain, parameter, subclass).
pub(crate) fn is_tensor_call(v: &Value) -> bool {
    matches!(
        v.class(),
        Some((
            "torch._utils",
            "_rebuild_tensor_v2"
                | "_rebuild_tensor_v3"
                | "_rebuild_parameter"
                | "_rebuild_parameter_with_state"
        )) | Some(("torch._tensor", "_rebuild_from_type_v2"))
    )
}

/// The kind of the first tensor (or bare storage) found inside `v`, if any.
fn nested_tensor(v: &Value) -> Option<&'static str> {
    if is_tensor_call(v) {
        return Some("tensor");
    }
    match v {
        Value::PersistentId(_) => Some("storage"),
        Value::List(items) | Value::Tuple(items) | Value::Set(items) => {
            items.iter().find_map(nested_tensor)
        }
        Value::Dict(pairs) => pairs
            .iter()
            .find_map(|(k, x)| nested_tensor(k).or_else(|| nested_tensor(x))),
        Value::Object { args, state, .. } => args
            .iter()
            .find_map(nested_tensor)
            .or_else(|| state.as_deref().and_then(nested_tensor)),
        _ => None,
    }
}

/// Python's `str(key)` for the dict keys a state dict can have.
fn key_text(k: &Value) -> Option<String> {
    Some(match k {
        Value::Str(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::None => "None".into(),
        _ => return None,
    })
}

/// `nn.Module.state_dict()` returns an `OrderedDict` with a `_metadata` attribute (per-module
/// versions), which pickles as a `BUILD` of `{"_metadata": OrderedDict({prefix: {"version":
/// n, ...}})}` after the items. The pickle reader merges a dict's `BUILD` state into its
/// items; this recognizes that last pair so it is dropped, as `torch.load` keeps it an
/// attribute, not a key.
pub fn is_module_metadata(pairs: &[(Value, Value)], i: usize) -> bool {
    i + 1 == pairs.len()
        && pairs[i].0.as_str() == Some("_metadata")
        && pairs[i].1.as_dict().is_some_and(|m| {
            !m.is_empty()
                && m.iter().all(|(prefix, info)| {
                    prefix.as_str().is_some() && info.get("version").is_some()
                })
        })
}

/// The flattening walk.
struct Walker<'a> {
    path: &'a Path,
    archive: &'a Archive,
    bytes: &'a [u8],
    tensors: Vec<TensorLayout>,
    extras: Vec<Extra>,
    paths: BTreeMap<String, Vec<KeyPart>>,
    seen: HashSet<String>,
    /// CRC-32s of the storage records used, once per record.
    checksums: Vec<RecordCrc>,
    records: HashSet<u64>,
    /// `_is_terminal` of the lists met so far, by address (values outlive the walk).
    terminal: HashMap<*const Value, bool>,
}

fn flat_name(parts: &[KeyPart]) -> String {
    let mut s = String::new();
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            s.push('.');
        }
        s.push_str(&p.text());
    }
    s
}

impl<'a> Walker<'a> {
    /// A walk over the archive `archive` held in `bytes` (the content of `path`).
    fn new(path: &'a Path, archive: &'a Archive, bytes: &'a [u8]) -> Walker<'a> {
        Walker {
            path,
            archive,
            bytes,
            tensors: vec![],
            extras: vec![],
            paths: BTreeMap::new(),
            seen: HashSet::new(),
            checksums: vec![],
            records: HashSet::new(),
            terminal: HashMap::new(),
        }
    }

    fn err(&self, parts: &[KeyPart], msg: impl std::fmt::Display) -> Error {
        Error::format(self.path, format!("`{}`: {msg}", short(&flat_name(parts))))
    }

    fn dict(&mut self, parts: &mut Vec<KeyPart>, pairs: &[(Value, Value)]) -> Result<()> {
        for (i, (k, v)) in pairs.iter().enumerate() {
            if is_module_metadata(pairs, i) {
                continue;
            }
            let key = key_text(k).ok_or_else(|| {
                self.err(
                    parts,
                    format!(
                        "has a {} dict key; only str, int, bool and None keys are supported",
                        k.kind()
                    ),
                )
            })?;
            parts.push(match k {
                Value::Int(i) => KeyPart::IntKey { int: *i },
                _ => KeyPart::Key(key),
            });
            self.value(parts, v)?;
            parts.pop();
        }
        Ok(())
    }

    /// DCP's `_is_terminal` negated, for a list: it holds a tensor, or a dict, or a list
    /// that is not terminal.
    fn list_traversed(&mut self, v: &Value) -> bool {
        let Value::List(items) = v else {
            return false;
        };
        let at = v as *const Value;
        if let Some(&t) = self.terminal.get(&at) {
            return !t;
        }
        let deep = items.iter().any(|x| match x {
            Value::Dict(_) => true,
            Value::List(_) => self.list_traversed(x),
            _ => is_tensor_call(x),
        });
        self.terminal.insert(at, !deep);
        deep
    }

    fn value(&mut self, parts: &mut Vec<KeyPart>, v: &Value) -> Result<()> {
        match v {
            // An empty dict below the top (an optimizer's `state` before its first step) is
            // kept as a value, so that it is still there when the dict is rebuilt (DCP drops
            // it).
            Value::Dict(pairs) if !parts.is_empty() && pairs.is_empty() => self.leaf(parts, v),
            Value::Dict(pairs) => self.dict(parts, pairs),
            Value::List(items) if self.list_traversed(v) => {
                for (i, x) in items.iter().enumerate() {
                    parts.push(KeyPart::Index(i as i64));
                    self.value(parts, x)?;
                    parts.pop();
                }
                Ok(())
            }
            _ if is_tensor_call(v) => {
                let t = save::tensor_of(v, self.archive, self.bytes)
                    .map_err(|e| self.err(parts, e))?
                    .ok_or_else(|| {
                        let (m, n) = v.class().unwrap_or_default();
                        self.err(
                            parts,
                            format!(
                                "{}.{} is not a plain tensor (tensor subclasses are not supported)",
                                short(m),
                                short(n)
                            ),
                        )
                    })?;
                let name = self.name(parts)?;
                if self.records.insert(t.record.offset) {
                    let rec = format!("{}/data/{}", self.archive.prefix, t.storage_key);
                    if let Some(entry) = self.archive.entry(&rec) {
                        self.checksums.push(RecordCrc {
                            file: 0,
                            offset: t.record.offset,
                            len: t.record.len,
                            crc: entry.crc,
                            what: format!("tensor `{}` (record {rec})", short(&name)).into(),
                            shown: None,
                        });
                    }
                }
                self.tensors.push(layout(name, &t));
                Ok(())
            }
            _ => {
                if let Some(kind) = nested_tensor(v) {
                    return Err(self.err(
                        parts,
                        format!(
                            "a {kind} inside a {}; only dicts and lists may hold tensors",
                            v.kind()
                        ),
                    ));
                }
                self.leaf(parts, v)
            }
        }
    }

    /// A non-tensor value at `parts`.
    fn leaf(&mut self, parts: &[KeyPart], v: &Value) -> Result<()> {
        let name = self.name(parts)?;
        self.extras.push(Extra {
            name,
            value: dcp::to_json(v),
            pickle: Some(v.clone()),
            raw: None,
            origin: "pt",
            opaque: None,
        });
        Ok(())
    }

    /// The flat name of a leaf at `parts`, recording its path when it is nested.
    fn name(&mut self, parts: &[KeyPart]) -> Result<String> {
        let name = flat_name(parts);
        if !self.seen.insert(name.clone()) {
            return Err(self.err(parts, "the flat key is duplicated (as in DCP's flatten)"));
        }
        if !matches!(parts, [KeyPart::Key(k)] if *k == name) {
            self.paths.insert(name.clone(), parts.to_vec());
        }
        Ok(name)
    }
}

/// The layout of a saved tensor: one piece at its element 0 in file 0.
fn layout(name: String, t: &TensorItem) -> TensorLayout {
    let strides = (!t.is_row_major()).then(|| t.strides.clone());
    TensorLayout::whole(name, t.dtype, t.shape.clone(), 0, t.data_offset(), strides)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fixture(rel: &str) -> Vec<u8> {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/pt")
            .join(rel);
        std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    fn run(bytes: &[u8]) -> Result<Checkpoint> {
        decode(Path::new("x.pt"), bytes, None)
    }

    #[test]
    fn flattens_like_dcp() {
        let ck = run(&fixture("training/model.pt")).unwrap();
        let key = |s: &str| KeyPart::Key(s.into());
        assert_eq!(
            ck.paths["optimizer.param_groups.0.lr"],
            vec![
                key("optimizer"),
                key("param_groups"),
                KeyPart::Index(0),
                key("lr")
            ]
        );
        // int dict keys are named by str(), as DCP does, and stay ints in the path
        assert_eq!(
            ck.paths["optimizer.state.0.exp_avg"],
            vec![
                key("optimizer"),
                key("state"),
                KeyPart::IntKey { int: 0 },
                key("exp_avg")
            ]
        );
        assert!(!ck.paths.contains_key("step"));
        assert!(ck.tensor("model.fc1.weight").is_some());
        assert!(ck.extras.iter().all(|x| x.origin == "pt"));
        assert!(ck.producer.as_deref().unwrap().starts_with("torch.save"));
        // nn.Module's `_metadata` attribute is not a key
        assert!(ck.tensors.iter().all(|t| !t.name.contains("_metadata")));
        assert!(ck.extras.iter().all(|x| !x.name.contains("_metadata")));
    }

    #[test]
    fn terminal_lists_are_leaves() {
        let ck = run(&fixture("ordered/model.pt")).unwrap();
        let names: Vec<&str> = ck.extras.iter().map(|x| x.name.as_str()).collect();
        for n in [
            "numbers",
            "empty_list",
            "nested_lists",
            "layers.1.tag",
            "layers.2",
        ] {
            assert!(names.contains(&n), "{n} not in {names:?}");
        }
        assert!(ck.tensor("layers.0").is_some());
        assert!(ck.tensor("by_id.3.inner").is_some());
        assert_eq!(ck.paths["layers.0"][1], KeyPart::Index(0));
        // a top-level key with a dot keeps no path
        assert!(ck.tensor("dotted.key").is_some());
        assert!(!ck.paths.contains_key("dotted.key"));
    }

    #[test]
    fn strides_and_offsets_of_views() {
        let ck = run(&fixture("views/model.pt")).unwrap();
        let base = &ck.tensor("base").unwrap().pieces[0].loc;
        let t = &ck.tensor("transposed").unwrap().pieces[0].loc;
        assert_eq!(t.offset, base.offset);
        assert_eq!(t.strides, Some(vec![1, 10]));
        let row = &ck.tensor("row").unwrap().pieces[0].loc;
        assert_eq!((row.offset, &row.strides), (base.offset + 160, &None));
        let cols = &ck.tensor("cols").unwrap().pieces[0].loc;
        assert_eq!(cols.offset, base.offset + 13 * 4);
        assert_eq!(cols.strides, Some(vec![10, 2]));
        let e = &ck.tensor("expanded").unwrap().pieces[0].loc;
        assert_eq!(e.strides, Some(vec![0, 1]));
    }

    #[test]
    fn refuses_what_is_not_a_state_dict() {
        let e = run(&fixture("bad/bare_tensor.pt")).unwrap_err().to_string();
        assert!(e.starts_with("x.pt: holds a single tensor"), "{e}");
        let e = run(&fixture("bad/top_list.pt")).unwrap_err().to_string();
        assert_eq!(e, "x.pt: holds a pickled list, not a state dict (a dict)");
        let e = run(&fixture("bad/tensor_in_tuple.pt"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "x.pt: `a.pair`: a tensor inside a tuple; only dicts and lists may hold tensors"
        );
        let e = run(&fixture("bad/legacy.pt")).unwrap_err().to_string();
        assert!(e.contains("legacy torch.save format"), "{e}");
        let e = run(&fixture("bad/missing_record.pt"))
            .unwrap_err()
            .to_string();
        assert_eq!(e, "x.pt: `w`: zip has no record `good/data/0`");
        let e = run(&fixture("bad/short_record.pt"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "x.pt: `w`: storage `0` has 48 bytes but its record holds 20"
        );
        assert!(run(b"").is_err());
    }

    #[test]
    fn duplicate_flat_keys_and_odd_keys_are_refused() {
        let archive = Archive::parse(&fixture("tied/model.pt")).unwrap();
        let mut w = Walker::new(Path::new("x.pt"), &archive, &[]);
        let s = |x: &str| Value::Str(x.into());
        let dup = vec![
            (s("a.b"), Value::Int(1)),
            (s("a"), Value::Dict(vec![(s("b"), Value::Int(2))])),
        ];
        let e = w.dict(&mut vec![], &dup).unwrap_err().to_string();
        assert_eq!(
            e,
            "x.pt: `a.b`: the flat key is duplicated (as in DCP's flatten)"
        );
        let odd = vec![(Value::Tuple(vec![]), Value::Int(1))];
        let e = w.dict(&mut vec![], &odd).unwrap_err().to_string();
        assert!(e.contains("has a tuple dict key"), "{e}");
        // a user dict with a `_metadata` key that is not nn.Module's is kept
        let mut w2 = Walker {
            seen: HashSet::new(),
            checksums: vec![],
            records: HashSet::new(),
            extras: vec![],
            ..w
        };
        let user = vec![(s("_metadata"), Value::Dict(vec![(s("k"), Value::Int(1))]))];
        w2.dict(&mut vec![], &user).unwrap();
        assert_eq!(w2.extras[0].name, "_metadata.k");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any mutation of a real file is read or refused with one line, never a panic, and
        /// every tensor read lies inside the file.
        #[test]
        fn mutated_files_never_panic(
            case in 0usize..5,
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            cut in proptest::option::of(any::<prop::sample::Index>()),
        ) {
            let name = ["flat_dtypes", "training", "tied", "views", "ordered"][case];
            let mut b = fixture(&format!("{name}/model.pt"));
            let n = b.len();
            for (i, x) in flips {
                b[i.index(n)] = x;
            }
            if let Some(c) = cut {
                b.truncate(c.index(n));
            }
            match run(&b) {
                Ok(ck) => {
                    for t in &ck.tensors {
                        let p = &t.pieces[0];
                        let end = p.loc.offset + p.span_bytes(t.dtype.size() as u64);
                        prop_assert!(end <= b.len() as u64, "{}", t.name);
                    }
                }
                Err(e) => prop_assert_eq!(e.to_string().lines().count(), 1),
            }
        }
    }
}
