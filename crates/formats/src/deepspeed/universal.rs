//! DeepSpeed Universal Checkpoints (UCP), as `deepspeed.checkpoint.ds_to_universal` writes
//! them: a tag folder (named by `latest_universal` in its parent) holding
//!
//! | file | holds |
//! |---|---|
//! | `zero/<param>/fp32.pt` | the parameter's fp32 master weights, whole: `{cat_dim, param}` (from stages 1 and 2) or a bare flat tensor (from stage 3) |
//! | `zero/<param>/{exp_avg,exp_avg_sq}.pt` | the optimizer state, the same way |
//! | `zero/<param>/step.pt` | the step, a 0-d tensor (from stages 1 and 2, with `--inject_missing_state`) |
//! | `zero/optimizer_state.pt` | the ZeRO wrapper's state: `param_groups` (each group's `params` the indices of its `param_shapes` entries), loss scaler, stage; from stage 3 also `optimizer_state_dict` with each flat tensor's `step` |
//! | `mp_rank_00_model_states.pt`, or `zero_pp_rank_<r>_mp_rank_00_model_states.pt` per rank | the source's model states files, copied |
//!
//! Read as the ZeRO reader reads a ZeRO checkpoint: parameters under their module names (fp32
//! master weights, or with [`Weights::Model`] the model-dtype `module` of stages 1 and 2),
//! buffers and frozen parameters from the model states (stage 3's frozen ones from every
//! rank's `frozen_param_fragments`), tied names with the layout of the parameter they share,
//! optimizer state as `optimizer.state.<name>.<key>`, param groups as
//! `optimizer.param_groups.<g>.<key>`, and the model states' other entries and the wrapper's
//! scalars as non-tensor entries. Every piece points into a `.pt` record.

use super::names::{self, Kind};
use super::partition;
use super::read::extra;
use super::records::{self, numel, File, ModelStates};
use crate::checkpoint::OpenOptions;
use crate::error::{Error, Result};
use crate::layout::{DType, Loc, Piece, Region, TensorLayout};
use crate::torch::pickle::Value;
use crate::torch::save::TensorItem;
use crate::torch::short;
use crate::{
    dcp, Aliasing, Capabilities, Checkpoint, Codec, Container, Extra, Family, Format, KeyPart,
    Output, Probe, Recognition, RecordCrc, TargetTensor, WriteOptions,
};
use reshard_core::model::Weights;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

/// The file in a checkpoint folder naming its universal tag folder.
pub const LATEST: &str = "latest_universal";

/// DeepSpeed Universal Checkpoints (`ds_to_universal`'s output).
pub struct Universal;

static UNIVERSAL_CAPS: Capabilities = Capabilities {
    name: "deepspeed-universal",
    aliases: &["ucp"],
    summary: "DeepSpeed Universal Checkpoint (ds_to_universal's zero/<param>/*.pt)",
    noun: "a DeepSpeed universal checkpoint",
    container: Container::Directory,
    extensions: &[],
    max_world: None,
    family: Family::Torch,
    extras_kept: "as the model states' entries (engine counters, ds_config, client state)",
    keeps_opaque: false,
    aliasing: Aliasing::CopyPerName,
    written: true,
};

/// True when the folder `probe` describes is a universal tag folder: a `zero` sub-folder
/// beside model states files and no ZeRO optim files.
pub fn is_tag_folder(probe: &Probe) -> bool {
    !probe.is_file
        && probe.dirs.iter().any(|d| d == "zero")
        && !probe
            .files
            .iter()
            .any(|n| matches!(names::kind(n), Some(Kind::Optim { .. })))
        && probe.files.iter().any(|n| {
            matches!(
                names::kind(n),
                Some(Kind::ModelStates { .. } | Kind::RankModelStates { .. })
            )
        })
}

impl Codec for Universal {
    fn capabilities(&self) -> &'static Capabilities {
        &UNIVERSAL_CAPS
    }
    fn recognize(&self, probe: &Probe) -> Recognition {
        // a folder with both `latest` and `latest_universal` is read as its ZeRO checkpoint
        Recognition::marker_if(
            is_tag_folder(probe)
                || (!probe.is_file
                    && probe.files.iter().any(|n| n == LATEST)
                    && !probe.files.iter().any(|n| n == "latest")),
        )
    }
    fn read(&self, path: &Path) -> Result<Checkpoint> {
        read(path, &OpenOptions::default())
    }
    fn read_weights(&self, path: &Path, weights: Weights) -> Result<Checkpoint> {
        read(
            path,
            &OpenOptions {
                weights: Some(weights),
                ..Default::default()
            },
        )
    }
    fn write(&self, target: &[TargetTensor], world: u32, opts: &WriteOptions) -> Result<Output> {
        super::write::write_universal(target, world, opts)
    }
}

/// The tag folder of the universal checkpoint at `path`: `path` itself when it holds
/// `zero/`, else the folder its `latest_universal` file names.
pub fn tag_dir(path: &Path) -> Result<PathBuf> {
    if path.join("zero").is_dir() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join(LATEST);
    if !latest.is_file() {
        return Err(Error::format(
            path,
            "holds no `zero` folder and no `latest_universal` file: not a DeepSpeed universal \
             checkpoint",
        ));
    }
    let tag = names::read_tag_file(&latest)?;
    let dir = path.join(&tag);
    if !dir.join("zero").is_dir() {
        return Err(Error::format(
            &latest,
            format!(
                "names tag `{}`, but {} holds no `zero` folder",
                short(&tag),
                dir.display()
            ),
        ));
    }
    Ok(dir)
}

/// One `zero/<param>/<key>.pt` file, opened: the tensor it holds.
struct StateFile {
    key: String,
    path: PathBuf,
    tensor: TensorItem,
    crc: Option<(String, u32)>,
}

/// The files of one parameter's folder, opened.
struct ParamFiles {
    name: String,
    shape: Vec<u64>,
    /// The index of its `param_shapes` entry (its flat tensor).
    flat: usize,
    fp32: StateFile,
    /// Every other `<key>.pt`, `step` included, sorted by key.
    state: Vec<StateFile>,
}

/// Open `zero/<name>/<key>.pt` (`path`): a `{cat_dim, param}` dict or a bare tensor, holding
/// a tensor of `shape` (or, flat, of its element count; `scalar`: a 0-d tensor).
fn state_file(path: &Path, key: &str, shape: &[u64], scalar: bool) -> Result<StateFile> {
    let f = File::open(path)?;
    let v = &f.value;
    let t = match v {
        Value::Dict(_) => {
            let param = records::field(&f, v, "param", "the dict")?;
            let t = f.tensor(param, "param")?;
            if let Some(c) = v.get("cat_dim") {
                let ok = c
                    .as_int()
                    .is_some_and(|c| c >= 0 && (c as u64) < (t.shape.len().max(1) as u64));
                if !ok {
                    return Err(f.err(format!(
                        "`cat_dim` is {}, not a dimension of the {}-dimensional `param`",
                        short(&dcp::to_json(c).to_string()),
                        t.shape.len()
                    )));
                }
            }
            t
        }
        other => f.tensor(other, key)?,
    };
    let want: &[u64] = if scalar { &[] } else { shape };
    let flat = t.shape.len() == 1 && t.shape[0] == numel(want) && want.len() != 1;
    if t.shape != want && !flat {
        return Err(f.err(format!(
            "holds a tensor of shape {:?}; the parameter's shape is {:?}",
            t.shape, want
        )));
    }
    if !t.is_row_major() {
        return Err(f.err("holds a tensor that is not contiguous"));
    }
    let mut tensor = t;
    tensor.shape = want.to_vec();
    tensor.strides = crate::layout::row_major_strides(want).to_vec();
    let crc = f.record_crc(&tensor).map(|c| {
        (
            format!("{}/data/{}", f.archive.prefix, tensor.storage_key),
            c,
        )
    });
    Ok(StateFile {
        key: key.to_string(),
        path: path.to_path_buf(),
        tensor,
        crc,
    })
}

/// Open the folder of parameter `name` (`shape`, flat tensor `flat`) under `zero`.
fn param_files(zero: &Path, name: &str, shape: &[u64], flat: usize) -> Result<ParamFiles> {
    let dir = zero.join(name);
    let fp32_path = dir.join("fp32.pt");
    if !fp32_path.is_file() {
        return Err(Error::format(
            &fp32_path,
            "is missing: every trainable parameter of the model states' param_shapes has its \
             fp32 master weights in a universal checkpoint",
        ));
    }
    let fp32 = state_file(&fp32_path, "fp32", shape, false)?;
    let mut keys: Vec<String> = crate::file_names(&dir)?
        .into_iter()
        .filter_map(|n| n.strip_suffix(".pt").map(str::to_string))
        .filter(|k| k != "fp32")
        .collect();
    keys.sort();
    let state = keys
        .iter()
        .map(|k| {
            let p = dir.join(format!("{k}.pt"));
            state_file(&p, k, shape, k == "step").map_err(|e| {
                // a moment of another shape than the master weights: name the moment's file
                if e.to_string().contains("the parameter's shape") {
                    Error::format(
                        &p,
                        format!(
                            "`{k}` does not have the shape {shape:?} of {}",
                            fp32_path.display()
                        ),
                    )
                } else {
                    e
                }
            })
        })
        .collect::<Result<_>>()?;
    Ok(ParamFiles {
        name: name.to_string(),
        shape: shape.to_vec(),
        flat,
        fp32,
        state,
    })
}

/// Read the universal checkpoint at `path` (a folder with `latest_universal`, or the tag
/// folder).
pub fn read(path: &Path, opts: &OpenOptions) -> Result<Checkpoint> {
    use rayon::prelude::*;
    let dir = tag_dir(path)?;
    let zero = dir.join("zero");
    let mut stage3 = false;
    for n in crate::file_names(&dir)? {
        match names::kind(&n) {
            Some(Kind::ModelStates { mp } | Kind::RankModelStates { mp, .. }) if mp != 0 => {
                return Err(Error::format(
                    dir.join(n),
                    "belongs to model-parallel rank > 0: tensor- or pipeline-parallel \
                     universal checkpoints are not supported (only mp_rank_00)",
                ))
            }
            Some(Kind::RankModelStates { .. }) => stage3 = true,
            Some(Kind::Optim { .. }) => {
                return Err(Error::format(
                    dir.join(n),
                    "is a ZeRO optim file in a universal checkpoint's folder",
                ))
            }
            _ => {}
        }
    }
    let first = dir.join(if stage3 {
        names::rank_model_states(0)
    } else {
        names::model_states()
    });
    if !first.is_file() {
        return Err(Error::format(
            &first,
            "is missing: a universal checkpoint keeps its source's model states file",
        ));
    }
    let model0 = File::open(&first)?;
    let states0 = ModelStates::decode(&model0)?;
    let dp = states0.dp_world_size;
    let mut models = vec![(model0, states0)];
    if stage3 {
        // the frozen parameters' chunks are in every rank's file
        let rest: Vec<(File, ModelStates)> = (1..dp)
            .into_par_iter()
            .map(|r| {
                let p = dir.join(names::rank_model_states(r));
                if !p.is_file() {
                    return Err(Error::format(
                        &p,
                        format!("is missing: the checkpoint was saved by {dp} data-parallel ranks"),
                    ));
                }
                let f = File::open(&p)?;
                let s = ModelStates::decode(&f)?;
                Ok((f, s))
            })
            .collect::<Result<_>>()?;
        models.extend(rest);
    }
    let opt_path = zero.join("optimizer_state.pt");
    if !opt_path.is_file() {
        return Err(Error::format(
            &opt_path,
            "is missing: a universal checkpoint holds the ZeRO wrapper's state there",
        ));
    }
    let opt = File::open(&opt_path)?;
    opt.top()?;

    // every trainable parameter's folder, opened in parallel
    let placed: Vec<(String, Vec<u64>, usize)> = models[0]
        .1
        .param_shapes
        .iter()
        .enumerate()
        .flat_map(|(i, g)| g.iter().map(move |(n, s)| (n.clone(), s.clone(), i)))
        .collect();
    let params: Vec<ParamFiles> = placed
        .par_iter()
        .map(|(n, s, i)| param_files(&zero, n, s, *i))
        .collect::<Result<_>>()?;

    let mut files: Vec<PathBuf> = models.iter().map(|(f, _)| f.path.clone()).collect();
    let opt_index = files.len() as u32;
    files.push(opt_path.clone());
    let mut r = Reader {
        dir: &dir,
        files,
        tensors: vec![],
        index: HashMap::new(),
        extras: vec![],
        paths: BTreeMap::new(),
        checksums: vec![],
    };
    r.module_tensors(
        &models,
        &params,
        stage3,
        opts.weights.unwrap_or(Weights::Master),
    )?;
    r.optimizer_state(&params, &opt, opt_index, stage3)?;
    r.param_groups(&opt, &models[0].1)?;
    for (k, v) in &models[0].1.others {
        if r.index.contains_key(k) {
            return Err(models[0]
                .0
                .err(format!("names `{}` as a tensor and as a value", short(k))));
        }
        r.extras.push(extra(k.clone(), v.clone()));
    }
    for (k, v) in opt.top()? {
        let Some(k) = k.as_str() else { continue };
        if !matches!(
            k,
            "param_groups"
                | "optimizer_state_dict"
                | "fp32_flat_groups"
                | "group_paddings"
                | "param_alignment_paddings"
                | "partition_count"
        ) {
            r.extras.push(extra(
                format!("optimizer_state_dict.{k}"),
                records::plain(v),
            ));
        }
    }
    let ds_version = models[0]
        .1
        .others
        .iter()
        .find(|(k, _)| k == "ds_version")
        .and_then(|(_, v)| v.as_str().map(short));
    let stage = opt
        .value
        .get("zero_stage")
        .map(records::plain)
        .and_then(|v| v.as_int());
    let producer = format!(
        "DeepSpeed{} universal checkpoint (from ZeRO stage {}, {dp} data-parallel rank(s))",
        ds_version.map(|v| format!(" {v}")).unwrap_or_default(),
        stage.map_or("?".to_string(), |s| s.to_string()),
    );
    Ok(Checkpoint {
        format: Format::DEEPSPEED_UNIVERSAL,
        path: path.to_path_buf(),
        files: r.files,
        side_files: Some(path.join(LATEST))
            .filter(|l| dir.as_path() != path && l.is_file())
            .into_iter()
            .collect(),
        ranks: 1,
        tensors: r.tensors,
        metadata: BTreeMap::new(),
        extras: r.extras,
        paths: r.paths,
        producer: Some(producer),
        saved: None,
        tag: dir.file_name().and_then(|n| n.to_str()).map(str::to_string),
        companions: vec![],
        scratch: vec![],
        checksums: r.checksums,
        locator: None,
        storage: reshard_storage::local(),
    })
}

/// The layouts, extras and files gathered so far.
struct Reader<'a> {
    dir: &'a Path,
    files: Vec<PathBuf>,
    tensors: Vec<TensorLayout>,
    index: HashMap<String, usize>,
    extras: Vec<Extra>,
    paths: BTreeMap<String, Vec<KeyPart>>,
    checksums: Vec<RecordCrc>,
}

impl Reader<'_> {
    fn push(&mut self, t: TensorLayout, path: Option<Vec<KeyPart>>) -> Result<()> {
        if self.index.contains_key(&t.name) {
            return Err(Error::format(
                self.dir,
                format!("names tensor `{}` twice", short(&t.name)),
            ));
        }
        if let Some(p) = path {
            self.paths.insert(t.name.clone(), p);
        }
        self.index.insert(t.name.clone(), self.tensors.len());
        self.tensors.push(t);
        Ok(())
    }

    /// The layout of `name` held whole by the state file `s` (a file of its own, appended).
    fn state_layout(&mut self, name: &str, s: &StateFile) -> TensorLayout {
        let file = self.files.len() as u32;
        self.files.push(s.path.clone());
        if let Some((what, crc)) = &s.crc {
            self.checksums.push(RecordCrc {
                file,
                offset: s.tensor.record.offset,
                len: s.tensor.record.len,
                crc: *crc,
                what: format!("`{}` (record {what})", short(name)).into(),
                shown: None,
            });
        }
        TensorLayout::whole(
            name.to_string(),
            s.tensor.dtype,
            s.tensor.shape.clone(),
            file,
            s.tensor.data_offset(),
            None,
        )
    }

    /// A tensor of a model states file (file index `file`), whole.
    fn module_whole(&mut self, name: &str, file: u32, f: &File, t: &TensorItem) -> TensorLayout {
        if let Some(crc) = f.record_crc(t) {
            if !self
                .checksums
                .iter()
                .any(|c| c.file == file && c.offset == t.record.offset)
            {
                self.checksums.push(RecordCrc {
                    file,
                    offset: t.record.offset,
                    len: t.record.len,
                    crc,
                    what: format!(
                        "`{}` (record {}/data/{})",
                        short(name),
                        f.archive.prefix,
                        t.storage_key
                    )
                    .into(),
                    shown: None,
                });
            }
        }
        let strides = (!t.is_row_major()).then(|| t.strides.clone());
        TensorLayout::whole(
            name.to_string(),
            t.dtype,
            t.shape.clone(),
            file,
            t.data_offset(),
            strides,
        )
    }

    /// Parameters, buffers, frozen parameters and tied names, in the order of `module`.
    fn module_tensors(
        &mut self,
        models: &[(File, ModelStates)],
        params: &[ParamFiles],
        stage3: bool,
        weights: Weights,
    ) -> Result<()> {
        let (f0, states) = &models[0];
        if stage3 && weights == Weights::Model {
            return Err(f0.err(
                "is a ZeRO stage 3 model states file, which keeps no model-dtype copy of the \
                 parameters (only placeholders): read the fp32 master weights",
            ));
        }
        let trainable: HashMap<&str, &ParamFiles> =
            params.iter().map(|p| (p.name.as_str(), p)).collect();
        let frozen: HashMap<&str, &Vec<u64>> = states
            .frozen_param_shapes
            .iter()
            .map(|(n, s)| (n.as_str(), s))
            .collect();
        let shared: HashMap<&str, &str> = states
            .shared_params
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        let module: HashMap<&str, &TensorItem> =
            states.module.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let in_module: HashSet<&str> = module.keys().copied().collect();
        let mut order: Vec<&str> = states.module.iter().map(|(n, _)| n.as_str()).collect();
        order.extend(
            params
                .iter()
                .map(|p| p.name.as_str())
                .chain(frozen.keys().copied())
                .filter(|n| !in_module.contains(n)),
        );
        let mut aliases = vec![];
        for name in order {
            if shared.contains_key(name) && !trainable.contains_key(name) {
                aliases.push(name);
                continue;
            }
            let layout = if let Some(p) = trainable.get(name) {
                match weights {
                    Weights::Master => self.state_layout(name, &p.fp32),
                    Weights::Model => {
                        let t = module.get(name).ok_or_else(|| {
                            f0.err(format!("parameter `{}` is not in `module`", short(name)))
                        })?;
                        if t.shape != p.shape {
                            return Err(f0.err(format!(
                                "`module.{}` has shape {:?}, param_shapes {:?}",
                                short(name),
                                t.shape,
                                p.shape
                            )));
                        }
                        self.module_whole(name, 0, f0, t)
                    }
                }
            } else if let (true, Some(shape)) = (stage3, frozen.get(name)) {
                frozen_fragments(name, shape, models)?
            } else {
                let t = module.get(name).ok_or_else(|| {
                    f0.err(format!(
                        "frozen parameter `{}` is not in `module`",
                        short(name)
                    ))
                })?;
                self.module_whole(name, 0, f0, t)
            };
            self.push(layout, None)?;
        }
        for alias in aliases {
            let source = shared[alias];
            let Some(&i) = self.index.get(source) else {
                return Err(f0.err(format!(
                    "shared parameter `{}` names `{}`, which is not a parameter",
                    short(alias),
                    short(source)
                )));
            };
            let mut t = self.tensors[i].clone();
            t.name = alias.to_string();
            self.push(t, None)?;
        }
        Ok(())
    }

    /// `optimizer.state.<name>.<key>` of every trainable parameter: its folder's files, and
    /// (from stage 3, which writes no `step.pt`) the step of its flat tensor in
    /// `optimizer_state.pt` (`opt`, file `opt_index`).
    fn optimizer_state(
        &mut self,
        params: &[ParamFiles],
        opt: &File,
        opt_index: u32,
        stage3: bool,
    ) -> Result<()> {
        for p in params {
            let mut keys: Vec<(String, TensorLayout)> = vec![];
            for s in &p.state {
                let name = format!("optimizer.state.{}.{}", p.name, s.key);
                keys.push((s.key.clone(), self.state_layout(&name, s)));
            }
            if stage3 && !p.state.iter().any(|s| s.key == "step") {
                if let Some(t) = flat_step(opt, p.flat)? {
                    let name = format!("optimizer.state.{}.step", p.name);
                    if let Some(crc) = opt.record_crc(&t) {
                        if !self
                            .checksums
                            .iter()
                            .any(|c| c.file == opt_index && c.offset == t.record.offset)
                        {
                            self.checksums.push(RecordCrc {
                                file: opt_index,
                                offset: t.record.offset,
                                len: t.record.len,
                                crc,
                                what: format!(
                                    "`{}` (record {}/data/{})",
                                    short(&name),
                                    opt.archive.prefix,
                                    t.storage_key
                                )
                                .into(),
                                shown: None,
                            });
                        }
                    }
                    keys.push((
                        "step".into(),
                        TensorLayout {
                            name,
                            dtype: t.dtype,
                            shape: vec![],
                            pieces: vec![Piece {
                                rank: 0,
                                region: Region::full(&[]),
                                loc: Loc {
                                    file: opt_index,
                                    offset: t.data_offset(),
                                    strides: None,
                                    pending: None,
                                },
                            }],
                        },
                    ));
                }
            }
            // moments first, then the step, as torch's Adam state lists them
            keys.sort_by_key(|(k, _)| (k == "step", k.clone()));
            for (key, layout) in keys {
                let path = vec![
                    KeyPart::Key("optimizer".into()),
                    KeyPart::Key("state".into()),
                    KeyPart::Key(p.name.clone()),
                    KeyPart::Key(key),
                ];
                self.push(layout, Some(path))?;
            }
        }
        Ok(())
    }

    /// `optimizer.param_groups.<g>.<key>`: each group's hyperparameters, and as `params` the
    /// names of the parameters of the `param_shapes` entries its `params` index.
    fn param_groups(&mut self, opt: &File, states: &ModelStates) -> Result<()> {
        let Some(groups) = opt.value.get("param_groups") else {
            return Ok(());
        };
        let groups = groups
            .as_list()
            .ok_or_else(|| opt.err(format!("`param_groups` is a {}, not a list", groups.kind())))?;
        for (g, group) in groups.iter().enumerate() {
            let what = format!("param_groups[{g}]");
            let mut entries = vec![];
            for (k, v) in records::str_dict(opt, group, &what)? {
                if k == "params" {
                    let idx = v.as_list().ok_or_else(|| {
                        opt.err(format!("`{what}.params` is a {}, not a list", v.kind()))
                    })?;
                    let mut names = vec![];
                    for i in idx {
                        let i = records::count(opt, i, &format!("{what}.params"))? as usize;
                        let shapes = states.param_shapes.get(i).ok_or_else(|| {
                            opt.err(format!(
                                "`{what}.params` names flat tensor {i}; the model states' \
                                 param_shapes has {}",
                                states.param_shapes.len()
                            ))
                        })?;
                        names.extend(shapes.iter().map(|(n, _)| Value::Str(n.clone())));
                    }
                    entries.push(("params".to_string(), Value::List(names)));
                } else {
                    entries.push((k.to_string(), records::plain(v)));
                }
            }
            for (k, v) in entries {
                let name = format!("optimizer.param_groups.{g}.{k}");
                self.paths.insert(
                    name.clone(),
                    vec![
                        KeyPart::Key("optimizer".into()),
                        KeyPart::Key("param_groups".into()),
                        KeyPart::Index(g as i64),
                        KeyPart::Key(k),
                    ],
                );
                self.extras.push(extra(name, v));
            }
        }
        Ok(())
    }
}

/// From stage 3: `optimizer_state_dict.state[flat].step` of `optimizer_state.pt`, if any.
fn flat_step(opt: &File, flat: usize) -> Result<Option<TensorItem>> {
    let Some(state) = opt
        .value
        .get("optimizer_state_dict")
        .and_then(|o| o.get("state"))
        .and_then(|s| s.as_dict())
    else {
        return Ok(None);
    };
    let Some((_, entry)) = state.iter().find(|(k, _)| k.as_int() == Some(flat as i64)) else {
        return Ok(None);
    };
    let Some(step) = entry.get("step") else {
        return Ok(None);
    };
    let t = opt.tensor(step, &format!("optimizer_state_dict.state[{flat}].step"))?;
    if !t.shape.is_empty() {
        return Err(opt.err(format!(
            "`optimizer_state_dict.state[{flat}].step` has shape {:?}, not a scalar",
            t.shape
        )));
    }
    Ok(Some(t))
}

/// A frozen parameter of `shape` at stage 3: chunked over the ranks, each rank's chunk in its
/// model states file's `frozen_param_fragments` (file index = rank).
fn frozen_fragments(
    name: &str,
    shape: &[u64],
    models: &[(File, ModelStates)],
) -> Result<TensorLayout> {
    let dp = models.len() as u64;
    let n = numel(shape);
    let c = partition::chunk(n, dp);
    let mut frags = vec![];
    for (f, s) in models {
        let t = s
            .frozen_fragments
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, t)| t)
            .ok_or_else(|| {
                f.err(format!(
                    "frozen parameter `{}` has no frozen_param_fragments entry",
                    short(name)
                ))
            })?;
        if t.shape.len() != 1 || !t.is_row_major() || t.shape[0] < c.min(n) {
            return Err(f.err(format!(
                "frozen_param_fragments.{} is not a flat chunk of {c} elements",
                short(name)
            )));
        }
        frags.push(t);
    }
    let dtype: DType = frags[0].dtype;
    if frags.iter().any(|t| t.dtype != dtype) {
        return Err(models[0].0.err(format!(
            "frozen_param_fragments.{} has another dtype on another rank",
            short(name)
        )));
    }
    let spans = partition::chunk_spans(n, c, dp, 0);
    let mut pieces = partition::flat_pieces(
        shape,
        &spans,
        |r| (r as u32, frags[r as usize].data_offset()),
        dtype.size() as u64,
    );
    // one reader holds every file
    for p in &mut pieces {
        p.rank = 0;
    }
    Ok(TensorLayout {
        name: name.to_string(),
        dtype,
        shape: shape.to_vec(),
        pieces,
    })
}
