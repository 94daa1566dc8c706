//! `reshard._reshard`: the native module of the Python package — a thin PyO3 binding of the
//! reshard library's public API. It holds no logic of its own: opening, layouts, local
//! shards, reading, converting, verifying and diffing are the library's; this file turns
//! arguments and results into Python values and library errors into Python exceptions
//! (with the same one-line messages as the command line).
//!
//! torch is never linked: tensors are filled through the address and size of their memory
//! (`data_ptr()`, `nbytes`), which the Python side passes in and keeps alive for the call.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use pyo3::IntoPyObjectExt;
use reshard::layout::{DType, Mesh, Placement, Region, Sharding};
use reshard::load::{self, LocalPart, LocalTensor};
use reshard::{Checkpoint, ConvertOptions, Error, Format, Hint, LayoutSpec, Selection};
use std::path::PathBuf;
use std::sync::Arc;

create_exception!(
    reshard,
    ReshardError,
    PyException,
    "Every error reshard raises: one line naming the file or tensor and the problem."
);
create_exception!(
    reshard,
    CheckpointError,
    ReshardError,
    "A checkpoint that cannot be read as its format says: missing, truncated or corrupt files, bad layouts."
);
create_exception!(
    reshard,
    RequestError,
    ReshardError,
    "A request that cannot be carried out as asked: a bad option, a key the checkpoint lacks, a shape or dtype that does not fit."
);
create_exception!(
    reshard,
    InternalError,
    ReshardError,
    "A bug in reshard: a state its own checks should have made impossible (please report it)."
);
create_exception!(
    reshard,
    ReshardIOError,
    ReshardError,
    "An operating-system error on a named file (permissions, no space, unreadable)."
);

/// The Python words for the setting that would let a refused request through.
fn hint(e: &Error) -> String {
    match (e.hint(), e) {
        (Some(Hint::Force), _) => " (pass overwrite=True to replace it)".into(),
        (Some(Hint::PerRankState), _) => {
            ": pass per_rank_state=\"drop\" (leave it out) or per_rank_state=\"rank0\" (keep rank 0's)".into()
        }
        (Some(Hint::Tag), _) => " with tag=\"NAME\"".into(),
        (Some(Hint::FormatFromName(ext)), _) => {
            format!(", or leave format out to write one .{ext} file")
        }
        (Some(Hint::FolderFormat(name)), _) => match Format::named(name) {
            Some(f) => format!(" (with format=\"{name}\" for {})", f.capabilities().noun),
            None => String::new(),
        },
        (Some(Hint::WorldSize), Error::TooManyRanks { world, .. }) => {
            let more: Vec<String> = Format::all()
                .filter(|f| f.holds(*world) && f.capabilities().written)
                .map(|f| format!("format=\"{}\"", f.name()))
                .collect();
            format!(": use world_size=1, or {}", more.join(" or "))
        }
        _ => String::new(),
    }
}

/// A library error as the Python exception of its kind, with the CLI's one-line message.
fn py_err(e: Error) -> PyErr {
    let msg = format!("{e}{}", hint(&e));
    match e {
        Error::Io { .. } => ReshardIOError::new_err(msg),
        Error::Format { .. } | Error::Layout { .. } => CheckpointError::new_err(msg),
        Error::Internal(_) => InternalError::new_err(msg),
        _ => RequestError::new_err(msg),
    }
}

fn request(msg: impl Into<String>) -> PyErr {
    RequestError::new_err(msg.into())
}

fn dtype(name: &str) -> PyResult<DType> {
    name.parse::<DType>().map_err(request)
}

fn format_named(name: &str) -> PyResult<Format> {
    name.parse::<Format>().map_err(request)
}

fn selection(include: Option<Vec<String>>, exclude: Option<Vec<String>>) -> Selection {
    Selection {
        include: include.unwrap_or_default(),
        exclude: exclude.unwrap_or_default(),
        ..Default::default()
    }
}

/// How to open a source: a tag (sub-folder) or a step (`step-N`, `iter_000000N`), and which
/// weights (`master`, `model`).
fn open_options(
    tag: Option<String>,
    step: Option<u64>,
    weights: Option<&str>,
) -> PyResult<reshard::OpenOptions> {
    Ok(reshard::OpenOptions {
        tag,
        step,
        weights: weights
            .map(|w| w.parse::<reshard::Weights>().map_err(request))
            .transpose()?,
    })
}

/// The target layout: a layout JSON text, or `Shard(0)` over `world_size` ranks.
fn layout_spec(world_size: u64, layout: Option<&str>) -> PyResult<LayoutSpec> {
    match layout {
        Some(json) => {
            let spec = LayoutSpec::from_json(json.as_bytes()).map_err(py_err)?;
            if spec.world() != world_size {
                return Err(request(format!(
                    "world_size={world_size} disagrees with the layout's mesh {:?} ({} ranks)",
                    spec.mesh,
                    spec.world()
                )));
            }
            Ok(spec)
        }
        None if world_size == 0 => Err(request("world_size must be at least 1")),
        None => Ok(LayoutSpec::fsdp(world_size)),
    }
}

/// An open checkpoint (the library's `Checkpoint`): layouts and byte locations, no data.
#[pyclass(frozen, module = "reshard._reshard", name = "NativeCheckpoint")]
struct PyCheckpoint {
    ck: Arc<Checkpoint>,
}

/// A part of a destination: `(offsets, sizes, at)`.
type Part = (Vec<u64>, Vec<u64>, Vec<u64>);
/// One extra: `(name, origin, raw, pickled, opaque)`.
type ExtraItem<'py> = (
    String,
    &'static str,
    Option<Bound<'py, PyBytes>>,
    Option<Bound<'py, PyBytes>>,
    Option<String>,
);
/// One local region: `(name, dtype, global shape, offsets, sizes)`.
type RegionItem = (String, &'static str, Vec<u64>, Vec<u64>, Vec<u64>);

/// One destination of `read_into`: `(name, dtype, shape, parts, address, nbytes)`, each part
/// `(offsets, sizes, at)`.
type Dest = (String, String, Vec<u64>, Vec<Part>, usize, usize);

#[pymethods]
impl PyCheckpoint {
    /// The format's name (`dcp`, `pt`, `safetensors`, `hf`, `hf-storage`).
    #[getter]
    fn format(&self) -> &'static str {
        self.ck.format.name()
    }

    /// The path it was opened from.
    #[getter]
    fn path(&self) -> String {
        // Text, not a path object: pathlib would fold an object-store URL's `//`.
        self.ck.path.to_string_lossy().into_owned()
    }

    /// The data files it reads.
    #[getter]
    fn files(&self) -> Vec<String> {
        self.ck
            .file_names()
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect()
    }

    /// The world size it was saved at.
    #[getter]
    fn world_size(&self) -> u32 {
        self.ck.ranks
    }

    /// What wrote it, when the files say.
    #[getter]
    fn producer(&self) -> Option<String> {
        self.ck.producer.clone()
    }

    /// What the writer recorded of the save (DCP's `Metadata.storage_meta`, torch >= 2.4), or
    /// `None`: a dict with `checkpoint_id` (its text, or `None`), `checkpoint_id_path`
    /// (`"posix"` or `"windows"` when it was saved as a `pathlib` path, else `None`),
    /// `save_id` (`None` when not saved) and `modules` (a list of str).
    #[getter]
    fn storage_meta<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(sm) = &self.ck.saved else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        let id = sm.checkpoint_id.as_ref();
        d.set_item("checkpoint_id", id.map(|i| i.text.as_str()))?;
        d.set_item(
            "checkpoint_id_path",
            id.and_then(|i| i.path).map(|f| f.name()),
        )?;
        d.set_item("save_id", sm.save_id.as_deref())?;
        d.set_item("modules", &sm.modules)?;
        Ok(Some(d))
    }

    /// String metadata (safetensors headers).
    #[getter]
    fn metadata(&self) -> Vec<(String, String)> {
        self.ck
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Bytes of all tensors.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.ck.nbytes()
    }

    /// Every tensor as `(name, dtype, shape, layout summary)`.
    fn tensors(&self) -> Vec<(String, &'static str, Vec<u64>, String)> {
        self.ck
            .tensors
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    t.dtype.name(),
                    t.shape.clone(),
                    reshard::layout::summary(t),
                )
            })
            .collect()
    }

    /// The names of the non-tensor entries, in order, read from nothing: they were decoded
    /// when the checkpoint was opened.
    fn extra_names(&self) -> Vec<String> {
        self.ck.extras.iter().map(|e| e.name.clone()).collect()
    }

    /// Every non-tensor entry (or those named in `names`, in the checkpoint's order) as
    /// `(name, origin, raw, pickled, opaque)`: `raw` the serialized item as stored (a DCP
    /// `BYTE_IO` item is a `torch.save` stream, read now), `pickled` the value as a plain
    /// protocol-2 pickle, except for an opaque value (one whose pickle names a global outside
    /// the allow-list: `pickled` is `None`, `opaque` that global's dotted name).
    #[pyo3(signature = (names=None))]
    fn extras<'py>(
        &self,
        py: Python<'py>,
        names: Option<Vec<String>>,
    ) -> PyResult<Vec<ExtraItem<'py>>> {
        let wanted: Option<std::collections::HashSet<String>> =
            names.map(|n| n.into_iter().collect());
        let mut out = vec![];
        for e in &self.ck.extras {
            if wanted.as_ref().is_some_and(|w| !w.contains(&e.name)) {
                continue;
            }
            let raw = match e.raw {
                Some((file, offset, len)) => {
                    Some(PyBytes::new(py, &read_raw(&self.ck, file, offset, len)?))
                }
                None => None,
            };
            let pickled = match e.opaque {
                Some(_) => None,
                None => Some(PyBytes::new(py, &reshard::extra_pickle(e))),
            };
            let opaque = e.opaque.as_ref().map(|o| o.global.clone());
            out.push((e.name.clone(), e.origin, raw, pickled, opaque));
        }
        Ok(out)
    }

    /// The nested path of each flat key that has one: `{name: [part, ...]}`, a part a str
    /// (dict key) or an int (list index or int dict key).
    fn paths<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, parts) in &self.ck.paths {
            let items: Vec<Bound<'py, PyAny>> = parts
                .iter()
                .map(|p| match p {
                    reshard::KeyPart::Key(k) => k.clone().into_bound_py_any(py),
                    reshard::KeyPart::Index(i) | reshard::KeyPart::IntKey { int: i } => {
                        (*i).into_bound_py_any(py)
                    }
                })
                .collect::<PyResult<_>>()?;
            d.set_item(name, items)?;
        }
        Ok(d)
    }

    /// Groups of tied tensors (same dtype, shape and bytes), by name.
    fn tied_names(&self, py: Python<'_>) -> PyResult<Vec<Vec<String>>> {
        let ck = self.ck.clone();
        py.detach(move || ck.tied_names()).map_err(py_err)
    }

    /// Which of `names` the include and exclude globs keep.
    #[pyo3(signature = (names, *, include=None, exclude=None))]
    fn keeps(
        &self,
        names: Vec<String>,
        include: Option<Vec<String>>,
        exclude: Option<Vec<String>>,
    ) -> PyResult<Vec<bool>> {
        let sel = selection(include, exclude);
        sel.check().map_err(py_err)?;
        Ok(names.iter().map(|n| sel.keeps(n)).collect())
    }

    /// The regions rank `rank` of `world_size` holds under a layout (JSON text, or
    /// `Shard(0)`), as `(name, dtype, global shape, offsets, sizes)`.
    #[pyo3(signature = (rank, world_size, *, layout=None, include=None, exclude=None, dtype=None))]
    fn local_regions(
        &self,
        rank: u64,
        world_size: u64,
        layout: Option<&str>,
        include: Option<Vec<String>>,
        exclude: Option<Vec<String>>,
        dtype: Option<&str>,
    ) -> PyResult<Vec<RegionItem>> {
        let spec = layout_spec(world_size, layout)?;
        let dt = dtype.map(self::dtype).transpose()?;
        let regions = load::local_regions(&self.ck, &spec, rank, &selection(include, exclude), dt)
            .map_err(py_err)?;
        Ok(regions
            .into_iter()
            .map(|r| {
                (
                    r.name,
                    r.dtype.name(),
                    r.global_shape,
                    r.region.offsets.to_vec(),
                    r.region.sizes.to_vec(),
                )
            })
            .collect())
    }

    /// Fill destinations from the checkpoint, with the GIL released and the copies spread
    /// over threads. Each destination is `(name, dtype, shape, parts, address, nbytes)`: the
    /// memory at `address` (a contiguous CPU tensor's `data_ptr()`, which the caller keeps
    /// alive and does not touch during the call) receives the parts of tensor `name` in
    /// `dtype`; a part `(offsets, sizes, at)` is the global region at `offsets`/`sizes`
    /// placed at index `at` of the destination. Everything is checked before a byte is
    /// written.
    #[pyo3(signature = (dests, progress=None))]
    fn read_into(
        &self,
        py: Python<'_>,
        dests: Vec<Dest>,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let (tensors, addrs) = destinations(dests)?;
        let ck = self.ck.clone();
        py.detach(move || {
            polled(progress.as_ref(), &addrs, |done| {
                with_buffers(&addrs, |outs| {
                    load::read_local_tensors_into_counted(&ck, &tensors, outs, done)
                })
            })
        })
        .map_err(py_err)
    }

    /// The tensors of the other framework a recipe reads this checkpoint as (a megatron-core
    /// checkpoint as Hugging Face's, and the reverse): the recipe's name and why it applies,
    /// and each target as `(name, dtype, shape, view JSON)`. `recipe`: a built-in's name or a
    /// file (default: the one the checkpoint's configuration calls for); `params`: a JSON
    /// object of parameters; `memory`: the names a model holds in memory where the recipe
    /// says they differ from its files'.
    #[pyo3(signature = (recipe=None, params=None, memory=false))]
    fn recipe_targets(
        &self,
        recipe: Option<String>,
        params: Option<String>,
        memory: bool,
    ) -> PyResult<RecipeTargets> {
        let mut opts = reshard::recipe::RecipeOptions {
            recipe,
            memory,
            ..Default::default()
        };
        if let Some(p) = params {
            opts.params = serde_json::from_str(&p).map_err(|e| {
                request(format!(
                    "params must be a dict of numbers, booleans and strings: {e}"
                ))
            })?;
        }
        let a = reshard::recipe::for_loading(&self.ck, &opts).map_err(py_err)?;
        let shape_of = |n: &str| self.ck.tensor(n).map(|t| t.shape.clone());
        let mut targets = vec![];
        for (name, view) in &a.instance.targets {
            let src = view.sources()[0];
            let dtype = self.ck.tensor(src).map_or("F32", |t| t.dtype.name());
            let shape = view.shape(name, &shape_of).map_err(py_err)?;
            let json = serde_json::to_string(view).map_err(|e| request(e.to_string()))?;
            targets.push((name.clone(), dtype, shape, json));
        }
        Ok((a.name, a.reason, targets))
    }

    /// Fill destinations as `read_into` does, where destination `i` is the target that
    /// `views[i]` (a view's JSON, from `recipe_targets`) defines of this checkpoint's tensors.
    #[pyo3(signature = (dests, views, progress=None))]
    fn read_views_into(
        &self,
        py: Python<'_>,
        dests: Vec<Dest>,
        views: Vec<String>,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let views: Vec<reshard::layout::View> = views
            .iter()
            .map(|v| serde_json::from_str(v).map_err(|e| request(format!("a bad view: {e}"))))
            .collect::<PyResult<_>>()?;
        let (tensors, addrs) = destinations(dests)?;
        let ck = self.ck.clone();
        py.detach(move || {
            let refs: Vec<&reshard::layout::View> = views.iter().collect();
            polled(progress.as_ref(), &addrs, |done| {
                with_buffers(&addrs, |outs| {
                    load::read_view_tensors_into_counted(&ck, &tensors, &refs, outs, done)
                })
            })
        })
        .map_err(py_err)
    }
}

/// A destination's memory: `(address, nbytes)`.
type Span = (usize, usize);

/// What `recipe_targets` returns: the recipe's name, why it applies, and its targets.
type RecipeTargets = (
    String,
    String,
    Vec<(String, &'static str, Vec<u64>, String)>,
);

/// The destinations of `read_into` as the library's local tensors, and their memory as
/// `(address, nbytes)`: every size checked, no null address, no two sharing a byte.
fn destinations(dests: Vec<Dest>) -> PyResult<(Vec<LocalTensor>, Vec<Span>)> {
    let mut tensors = Vec::with_capacity(dests.len());
    let mut spans = Vec::with_capacity(dests.len());
    for (name, dt, shape, parts, addr, nbytes) in dests {
        let lt = LocalTensor {
            dtype: dtype(&dt)?,
            shape,
            parts: parts
                .into_iter()
                .map(|(offsets, sizes, at)| LocalPart {
                    region: Region::new(offsets, sizes),
                    at,
                })
                .collect(),
            name,
        };
        if lt.nbytes() != nbytes as u64 {
            return Err(request(format!(
                "tensor `{}`: a destination of {:?} {} is {} bytes, the memory given {nbytes}",
                lt.name,
                lt.shape,
                lt.dtype,
                lt.nbytes()
            )));
        }
        if nbytes > 0 && addr == 0 {
            return Err(request(format!("tensor `{}`: a null destination", lt.name)));
        }
        spans.push((addr, nbytes, lt.name.clone()));
        tensors.push(lt);
    }
    // Destinations are written from several threads: they must not share a byte.
    let mut sorted: Vec<&(usize, usize, String)> = spans.iter().filter(|s| s.1 > 0).collect();
    sorted.sort_by_key(|s| s.0);
    for w in sorted.windows(2) {
        if w[0].0.saturating_add(w[0].1) > w[1].0 {
            return Err(request(format!(
                "destinations of `{}` and `{}` share memory",
                w[0].2, w[1].2
            )));
        }
    }
    Ok((tensors, spans.iter().map(|s| (s.0, s.1)).collect()))
}

/// Run `f` over the destinations' memory as byte slices.
fn with_buffers<T>(addrs: &[(usize, usize)], f: impl FnOnce(&mut [&mut [u8]]) -> T) -> T {
    let mut outs: Vec<&mut [u8]> = addrs
        .iter()
        .map(|&(addr, n)| {
            if n == 0 {
                return &mut [][..];
            }
            // SAFETY: the caller passes the address and byte size of memory it owns (a
            // contiguous CPU tensor it keeps alive and leaves alone for the duration of this
            // call); `destinations` checked the spans to be non-null and pairwise disjoint, so
            // no two slices alias.
            unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, n) }
        })
        .collect();
    f(&mut outs)
}

/// Run `work` (a read into the buffers `addrs`, counting the bytes it writes) and, when a
/// `progress` callable `(done_bytes, total_bytes)` is given, call it from this thread every
/// tenth of a second while the read runs on another, and once at the end. Called without
/// the GIL; each call takes it. An exception in the callable is reported as unraisable.
fn polled<T: Send>(
    progress: Option<&Py<PyAny>>,
    addrs: &[(usize, usize)],
    work: impl FnOnce(Option<&std::sync::atomic::AtomicU64>) -> T + Send,
) -> T {
    let Some(f) = progress else {
        return work(None);
    };
    let total: u64 = addrs.iter().map(|&(_, n)| n as u64).sum();
    let done = std::sync::atomic::AtomicU64::new(0);
    let call = |d: u64| {
        Python::attach(|py| {
            if let Err(e) = f.call1(py, (d.min(total), total)) {
                e.write_unraisable(py, None);
            }
        })
    };
    call(0);
    let out = std::thread::scope(|s| {
        let job = s.spawn(|| work(Some(&done)));
        while !job.is_finished() {
            std::thread::sleep(std::time::Duration::from_millis(100));
            if !job.is_finished() {
                call(done.load(std::sync::atomic::Ordering::Relaxed));
            }
        }
        job.join()
    });
    match out {
        Ok(v) => {
            call(total);
            v
        }
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// Read `len` bytes at `offset` of the checkpoint's file `file` (a non-tensor item).
fn read_raw(ck: &Checkpoint, file: u32, offset: u64, len: u64) -> PyResult<Vec<u8>> {
    ck.read_bytes(file as usize, offset, len).map_err(py_err)
}

/// Open a checkpoint of any supported format (detected, or `format` by name) for reading: the
/// layouts are validated now, a DCP item's own header when a read needs that item.
#[pyfunction]
#[pyo3(signature = (path, *, format=None, tag=None, step=None, weights=None))]
fn open(
    py: Python<'_>,
    path: PathBuf,
    format: Option<&str>,
    tag: Option<String>,
    step: Option<u64>,
    weights: Option<&str>,
) -> PyResult<PyCheckpoint> {
    let format = format.map(format_named).transpose()?;
    let opts = open_options(tag, step, weights)?;
    let ck = py
        .detach(move || Checkpoint::open_lazy_with(&path, format, &opts))
        .map_err(py_err)?;
    Ok(PyCheckpoint { ck: Arc::new(ck) })
}

/// What the rank at `coordinate` of a mesh of shape `mesh` holds of a tensor of
/// `global_shape` under `placements` (`Shard(0)`, `Replicate()`, `_StridedShard(dim=0, sf=2)`):
/// `(local shape, [(offsets, sizes, at), ...])`.
#[pyfunction]
fn local_tensor(
    global_shape: Vec<u64>,
    mesh: Vec<u64>,
    placements: Vec<String>,
    coordinate: Vec<u64>,
) -> PyResult<(Vec<u64>, Vec<Part>)> {
    let placements = placements
        .iter()
        .map(|p| p.parse::<Placement>().map_err(request))
        .collect::<PyResult<Vec<_>>>()?;
    let sharding = Sharding {
        mesh: Mesh(mesh),
        placements,
    };
    let lt = LocalTensor::of_sharding("tensor", DType::U8, &global_shape, &sharding, &coordinate)
        .map_err(|e| request(e.to_string()))?;
    Ok((
        lt.shape,
        lt.parts
            .into_iter()
            .map(|p| (p.region.offsets.to_vec(), p.region.sizes.to_vec(), p.at))
            .collect(),
    ))
}

/// Progress of a conversion, reported to a Python callable `(done_bytes, total_bytes)`.
struct Callback {
    f: Py<PyAny>,
    total: std::sync::atomic::AtomicU64,
    done: std::sync::atomic::AtomicU64,
}

impl Callback {
    fn call(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let (d, t) = (self.done.load(Relaxed), self.total.load(Relaxed));
        Python::attach(|py| {
            if let Err(e) = self.f.call1(py, (d, t)) {
                e.write_unraisable(py, None);
            }
        });
    }
}

impl reshard::Progress for Callback {
    fn start(&self, total_bytes: u64) {
        self.total
            .store(total_bytes, std::sync::atomic::Ordering::Relaxed);
        self.call();
    }
    fn advance(&self, bytes: u64) {
        self.done
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        self.call();
    }
    fn finish(&self) {
        let t = self.total.load(std::sync::atomic::Ordering::Relaxed);
        self.done.store(t, std::sync::atomic::Ordering::Relaxed);
        self.call();
    }
}

/// Declares the struct of a native function's `**options` and its extraction from the
/// keyword dict: each field is the keyword of its name, extracted as the field's type, its
/// default when absent. Any other keyword is refused with the `TypeError` Python gives for a
/// keyword a function lacks, so that the Python side and this one cannot drift silently.
macro_rules! keyword_options {
    ($(#[$doc:meta])* struct $name:ident for $func:literal {
        $($(#[$fdoc:meta])* $field:ident: $ty:ty = $default:expr,)*
    }) => {
        $(#[$doc])*
        struct $name {
            $($(#[$fdoc])* $field: $ty,)*
        }

        impl $name {
            /// The keywords, in declaration order.
            const NAMES: &'static [&'static str] = &[$(stringify!($field)),*];

            fn extract(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
                let mut out = Self { $($field: $default,)* };
                for (key, value) in kwargs.into_iter().flatten() {
                    let key = key.extract::<PyBackedStr>()?;
                    match &*key {
                        $(stringify!($field) => {
                            out.$field = value.extract::<$ty>().map_err(|e| {
                                argument_error(value.py(), stringify!($field), e.into())
                            })?;
                        })*
                        other => {
                            return Err(PyTypeError::new_err(format!(
                                concat!($func, "() got an unexpected keyword argument '{}'"),
                                other
                            )))
                        }
                    }
                }
                Ok(out)
            }
        }
    };
}

/// An argument's extraction error as PyO3 words it for a named parameter: a `TypeError`
/// prefixed with the argument's name, any other error as it is.
fn argument_error(py: Python<'_>, name: &str, e: PyErr) -> PyErr {
    if e.is_instance_of::<PyTypeError>(py) {
        let named = PyTypeError::new_err(format!("argument '{name}': {}", e.value(py)));
        named.set_cause(py, e.cause(py));
        named
    } else {
        e
    }
}

keyword_options! {
    /// The options of `convert` after `world_size`, as `reshard.convert` names them.
    struct ConvertArgs for "convert" {
        format: Option<String> = None,
        /// A layout JSON text.
        layout: Option<String> = None,
        include: Option<Vec<String>> = None,
        exclude: Option<Vec<String>> = None,
        strip_prefix: Option<String> = None,
        add_prefix: Option<String> = None,
        dtype: Option<String> = None,
        max_shard_size: Option<u64> = None,
        threads: Option<usize> = None,
        per_rank_state: Option<String> = None,
        untie: bool = false,
        overwrite: bool = false,
        verify: bool = true,
        /// A callable `(done_bytes, total_bytes)`.
        progress: Option<Py<PyAny>> = None,
        dry_run: bool = false,
        tag: Option<String> = None,
        step: Option<u64> = None,
        weights: Option<String> = None,
        zero_stage: Option<u8> = None,
        /// The split of a megatron-legacy output.
        tp: Option<u64> = None,
        pp: Option<u64> = None,
        ep: Option<u64> = None,
        /// A megatron output as a Megatron-LM save directory.
        save_dir: bool = false,
        config: Option<PathBuf> = None,
        /// `"env"` (from the launcher's environment) or `"K/N"`.
        part: Option<String> = None,
        staging: Option<PathBuf> = None,
        /// A built-in recipe's name or a recipe file (`"none"`: names kept).
        recipe: Option<String> = None,
        /// The recipe's parameters, a JSON object text.
        params: Option<String> = None,
    }
}

impl ConvertArgs {
    /// The library's options for a conversion to `world_size` ranks (or the layout given),
    /// and the part of it to run (`None`: the whole).
    fn into_options(
        self,
        world_size: u64,
    ) -> PyResult<(ConvertOptions, Option<(reshard::parts::Part, &'static str)>)> {
        let ConvertArgs {
            format,
            layout,
            include,
            exclude,
            strip_prefix,
            add_prefix,
            dtype,
            max_shard_size,
            threads,
            per_rank_state,
            untie,
            overwrite,
            verify,
            progress,
            dry_run: _,
            tag,
            step,
            weights,
            zero_stage,
            tp,
            pp,
            ep,
            save_dir,
            config,
            part,
            staging,
            recipe,
            params,
        } = self;
        // "env": from the launcher's environment; "K/N": that part; None: the whole conversion
        let part = match part.as_deref() {
            None => None,
            Some("env") => reshard::parts::choose(None).map_err(py_err)?,
            Some(p) => {
                let p: reshard::parts::Part = p.parse().map_err(request)?;
                reshard::parts::choose(Some(p)).map_err(py_err)?
            }
        };
        let mut opts = ConvertOptions::to(1);
        opts.open = open_options(tag, step, weights.as_deref())?;
        if let Some(s) = zero_stage {
            if !(1..=3).contains(&s) {
                return Err(request(format!("zero_stage must be 1, 2 or 3, not {s}")));
            }
            opts.write.zero_stage = Some(s);
        }
        for (name, v) in [("tp", tp), ("pp", pp), ("ep", ep)] {
            if v == Some(0) {
                return Err(request(format!("{name} must be at least 1")));
            }
        }
        (opts.write.tp, opts.write.pp, opts.write.ep) = (tp, pp, ep);
        opts.write.save_dir = save_dir;
        if let Some(p) = config {
            let bytes = reshard::read_model_config(&p).map_err(py_err)?;
            opts.write.companions = vec![("config.json".into(), bytes)];
        }
        opts.layout = layout_spec(world_size, layout.as_deref())?;
        opts.format = format.as_deref().map(format_named).transpose()?;
        opts.select = Selection {
            include: include.unwrap_or_default(),
            exclude: exclude.unwrap_or_default(),
            strip_prefix,
            add_prefix,
        };
        opts.dtype = dtype
            .as_deref()
            .map(|d| DType::cast_target(d).map_err(request))
            .transpose()?;
        if let Some(n) = max_shard_size {
            if n == 0 {
                return Err(request("max_shard_size must be at least 1 byte"));
            }
            opts.write.max_shard_size = n;
        }
        if threads == Some(0) {
            return Err(request("threads must be at least 1"));
        }
        opts.exec.threads = threads;
        opts.per_rank = per_rank_state
            .map(|p| p.parse().map_err(|e: String| request(e)))
            .transpose()?;
        opts.untie = untie;
        opts.force = overwrite;
        opts.verify = verify;
        opts.staging = staging;
        opts.recipe.recipe = recipe;
        if let Some(p) = params {
            opts.recipe.params = serde_json::from_str(&p).map_err(|e| {
                request(format!(
                    "params must be a dict of numbers, booleans and strings: {e}"
                ))
            })?;
        }
        opts.exec.progress = progress.map(|f| {
            Arc::new(Callback {
                f,
                total: 0.into(),
                done: 0.into(),
            }) as Arc<dyn reshard::Progress>
        });
        Ok((opts, part))
    }
}

/// Convert `src` into `dst` at `world_size` ranks (or a layout JSON text), returning a
/// summary dict: format (and why), world size, files written, bytes, dropped entries, ties.
/// The other options are keywords (`ConvertArgs`, listed in `CONVERT_OPTIONS`).
#[pyfunction]
#[pyo3(signature = (src, dst, *, world_size, **options))]
fn convert<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    world_size: u64,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyAny>> {
    let args = ConvertArgs::extract(options)?;
    let dry_run = args.dry_run;
    let (opts, part) = args.into_options(world_size)?;
    let summary = py
        .detach(move || -> reshard::Result<serde_json::Value> {
            let job = reshard::convert::prepare(&src, Some(&dst), &opts)?;
            let mut in_parts = serde_json::Value::Null;
            let mut aborted = vec![];
            let stats = match (dry_run, part) {
                (true, _) => None,
                (false, None) => {
                    let stats = reshard::convert::run(&job, &dst, &opts)?;
                    aborted = stats.aborted_uploads.clone();
                    Some(stats)
                }
                (false, Some((p, from))) => {
                    let run = reshard::convert::run_part(&job, &dst, &opts, p)?;
                    aborted = run.aborted_uploads.clone();
                    in_parts = serde_json::json!({
                        "part": [p.index, p.count],
                        "from": from,
                        "spans": run.spans.len(),
                        "written_before": run.stats.is_none(),
                        "missing": run.missing,
                        "committed": run.committed.as_ref().map(|c| match c {
                            reshard::convert::Committed::Published { .. } => "published",
                            reshard::convert::Committed::Already => "already",
                            reshard::convert::Committed::Busy => "busy",
                        }),
                    });
                    run.stats
                }
            };
            Ok(summary(&job, stats.as_ref(), in_parts, aborted))
        })
        .map_err(py_err)?;
    to_py(py, &summary)
}

/// The summary dict of a conversion: source, output format (and why), world size, tensors,
/// files written, bytes, dropped entries and ties, the part run, aborted uploads.
fn summary(
    job: &reshard::Job,
    stats: Option<&reshard::ExecStats>,
    parts: serde_json::Value,
    aborted: Vec<String>,
) -> serde_json::Value {
    let files = job.output_files();
    serde_json::json!({
        "source": job.source.path,
        "source_format": job.source.format.name(),
        "source_world_size": job.source.ranks,
        "format": job.format.name(),
        "format_reason": job.format_reason,
        "world_size": job.world,
        "tensors": job.plan.tensors.len(),
        "bytes": job.plan.tensors.iter().map(|t| t.bytes.1).sum::<u64>(),
        "extras": job.extras,
        "dropped": job.dropped,
        "ties": job.ties,
        "files": files,
        "bytes_read": stats.map(|s| s.bytes_read),
        "bytes_written": stats.map(|s| s.bytes_written),
        "parts": parts,
        "aborted_uploads": aborted,
        "recipe": job.recipe.as_ref().map(|a| serde_json::json!({
            "name": a.name,
            "reason": a.reason,
            "from": a.from,
            "to": a.to,
            "params": a.instance.params,
            "notes": a.notes,
        })),
    })
}

/// Commit a conversion run in parts: every part written and checked, then `dst` published.
/// Returns the bytes checked against the parts' CRC-32s (0 when it was already committed).
#[pyfunction]
#[pyo3(signature = (dst, *, overwrite=false, verify=true, staging=None))]
fn commit(
    py: Python<'_>,
    dst: PathBuf,
    overwrite: bool,
    verify: bool,
    staging: Option<PathBuf>,
) -> PyResult<u64> {
    py.detach(move || reshard::convert::commit_parts(&dst, staging.as_deref(), overwrite, verify))
        .map(|c| match c {
            reshard::convert::Committed::Published { checked } => checked,
            _ => 0,
        })
        .map_err(py_err)
}

/// Check a checkpoint's structure and every CRC-32 its files record: a report dict.
#[pyfunction]
fn verify(py: Python<'_>, path: PathBuf) -> PyResult<Bound<'_, PyAny>> {
    let report = py
        .detach(move || -> reshard::Result<serde_json::Value> {
            let ck = Checkpoint::open(&path)?;
            let report = reshard::verify::checksums(&ck)?;
            let mismatches: Vec<String> = report
                .mismatches
                .iter()
                .map(|m| m.to_error().to_string())
                .collect();
            Ok(serde_json::json!({
                "path": ck.path, "format": ck.format.name(), "world_size": ck.ranks,
                "tensors": ck.tensors.len(), "tensor_bytes": ck.nbytes(),
                "records": report.records, "bytes": report.bytes, "mismatches": mismatches,
            }))
        })
        .map_err(py_err)?;
    to_py(py, &report)
}

/// Compare two checkpoints tensor by tensor, whatever their formats and world sizes: a dict.
#[pyfunction]
fn diff(py: Python<'_>, a: PathBuf, b: PathBuf) -> PyResult<Bound<'_, PyAny>> {
    let d = py
        .detach(move || -> reshard::Result<serde_json::Value> {
            let (ca, cb) = (Checkpoint::open(&a)?, Checkpoint::open(&b)?);
            let d = reshard::diff::diff(&ca, &cb)?;
            Ok(serde_json::to_value(&d).expect("a diff serializes"))
        })
        .map_err(py_err)?;
    to_py(py, &d)
}

/// A JSON value as the Python value `json.loads` makes of its text: dicts (in the value's
/// key order), lists, str, int, float, bool and None.
fn to_py<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use serde_json::Value;
    match v {
        Value::Null => Ok(py.None().into_bound(py)),
        Value::Bool(b) => b.into_bound_py_any(py),
        Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
            (Some(u), _, _) => u.into_bound_py_any(py),
            (_, Some(i), _) => i.into_bound_py_any(py),
            (_, _, Some(f)) => f.into_bound_py_any(py),
            _ => unreachable!("a JSON number is a u64, an i64 or an f64"),
        },
        Value::String(s) => s.into_bound_py_any(py),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_py(py, item)?)?;
            }
            Ok(list.into_any())
        }
        Value::Object(map) => {
            let d = PyDict::new(py);
            for (k, item) in map {
                d.set_item(k, to_py(py, item)?)?;
            }
            Ok(d.into_any())
        }
    }
}

/// Names and summaries of the formats reshard reads and writes: `[(name, summary), ...]`.
#[pyfunction]
fn formats() -> Vec<(&'static str, &'static str)> {
    Format::all()
        .map(|f| (f.name(), f.capabilities().summary))
        .collect()
}

/// `(requests, bytes)`: the ranged GETs this process has sent to object stores so far, and
/// the bytes they returned.
#[pyfunction]
fn fetch_stats() -> (u64, u64) {
    let s = reshard::remote::fetch_stats();
    (s.requests, s.bytes)
}

/// Whether `path` is an object-store URL reshard reads and writes (`s3://`, `gs://`, ...).
#[pyfunction]
fn is_url(path: PathBuf) -> bool {
    reshard::remote::is_url(&path)
}

/// Run the `reshard` command line (`argv[0]` the program name) and return its exit status.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<String>) -> u8 {
    py.detach(move || reshard::cli::main(argv))
}

#[pymodule]
fn _reshard(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("ReshardError", py.get_type::<ReshardError>())?;
    m.add("CheckpointError", py.get_type::<CheckpointError>())?;
    m.add("RequestError", py.get_type::<RequestError>())?;
    m.add("ReshardIOError", py.get_type::<ReshardIOError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    m.add_class::<PyCheckpoint>()?;
    m.add_function(wrap_pyfunction!(open, m)?)?;
    m.add_function(wrap_pyfunction!(local_tensor, m)?)?;
    m.add_function(wrap_pyfunction!(convert, m)?)?;
    m.add_function(wrap_pyfunction!(commit, m)?)?;
    m.add_function(wrap_pyfunction!(verify, m)?)?;
    m.add_function(wrap_pyfunction!(diff, m)?)?;
    m.add_function(wrap_pyfunction!(formats, m)?)?;
    m.add_function(wrap_pyfunction!(fetch_stats, m)?)?;
    m.add_function(wrap_pyfunction!(is_url, m)?)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add("CONVERT_OPTIONS", PyTuple::new(py, ConvertArgs::NAMES)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
