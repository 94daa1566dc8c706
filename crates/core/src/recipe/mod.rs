//! Recipes: a declarative mapping from one framework's tensor names and fusions to another's,
//! parameterised by the model's configuration, that compiles to one [`View`] per target tensor.
//!
//! A [`Recipe`] is data (JSON; the format is documented in `docs/recipes.md`): named
//! parameters, each read from a framework's configuration (Megatron-LM's saved arguments, a
//! Hugging Face `config.json`) or given a default, and one [`Map`] per direction, a list of
//! [`Rule`]s. A rule names a target tensor (a template, `model.layers.{i}.self_attn.q_proj.weight`,
//! repeated `for` each index of a loop) and gives its [`ViewTemplate`]: a [`View`] whose numbers
//! are expressions of the parameters ([`expr`]). [`Recipe::instantiate`] resolves the
//! parameters, expands the loops, and returns every target's view of the source tensors,
//! checked: each target named once, each source tensor read by some rule or ignored by name, and
//! each view's arithmetic consistent with the source shapes.
//!
//! Stacked tensors: megatron-core's `torch_dist` stores a layer's tensors stacked on leading
//! axes (`decoder.layers.self_attention.linear_qkv.weight`, `[L, …]`). Rules name the
//! tensors per layer (`decoder.layers.{i}.self_attention.linear_qkv.weight`); a source named so
//! that is absent is read as the slice of the stacked tensor whose name drops the index
//! segments, and a map with `stacked` writes its targets that way (one `Concat` per stack).
//!
//! May import: the layout algebra ([`crate::layout`]) and the error type. No I/O: the caller
//! reads the recipe file and the configurations.

pub mod expr;

use crate::error::{Error, Result};
use crate::layout::View;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap, HashSet};

/// Most rules' expansions a recipe may produce (targets), against a hostile loop bound.
pub const MAX_TARGETS: usize = 1 << 20;

/// A recipe: its parameters and its maps, one per direction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// The recipe's name (`llama`).
    pub recipe: String,
    /// One line saying what models it is for.
    #[serde(default)]
    pub about: String,
    /// A recipe whose parameters and maps this one starts from (a built-in's name); its own
    /// parameters replace the base's of the same name, its maps the base's of the same direction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extends: Option<String>,
    /// The configuration values the maps use, by name.
    #[serde(default)]
    pub params: BTreeMap<String, Param>,
    /// The directions this recipe converts.
    #[serde(default)]
    pub maps: Vec<Map>,
}

/// One configuration value: where each framework's configuration holds it, or its default.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Param {
    /// What it means.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub about: String,
    /// By framework (`megatron`, `hf`): the configuration key holding it (dotted for a nested
    /// one; `a|b`: the first present), or `=EXPR` over that configuration's keys
    /// (`=group_query_attention ? num_query_groups : num_attention_heads`). A key the
    /// configuration lacks (or holds as `null`) falls to the default.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub from: BTreeMap<String, String>,
    /// The value when no configuration gives it: a JSON value, or `=EXPR` over the other
    /// parameters. Without one, the parameter must be given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<Value>,
    /// Said (with the value) when the default is taken: what that means for the output and
    /// how to give the value instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// One direction: the rules that define every tensor of the `to` framework's checkpoint from
/// the `from` framework's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Map {
    /// What the map is for, in words (shown to nobody; for the recipe's readers).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub about: String,
    /// The source framework (`megatron`, `hf`).
    pub from: String,
    /// The target framework.
    pub to: String,
    /// Write targets whose names hold index segments stacked, as megatron-core's `torch_dist`
    /// keeps them (see the module docs).
    #[serde(default)]
    pub stacked: bool,
    /// Source tensors no target reads, on purpose: glob patterns (`optimizer.**`,
    /// `*.inv_freq`). Any other source tensor no rule reads is an error.
    #[serde(default)]
    pub ignore: Vec<String>,
    /// The rules, one per target tensor (or family of them).
    pub tensors: Vec<Rule>,
    /// The configuration file written beside the target's tensors (`config.json`): a JSON
    /// template whose strings starting with `=` are expressions of the parameters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<Value>,
    /// Non-tensor entries the target framework's loader asks for (megatron-core's
    /// `_extra_state` objects of its linear layers), each with its value.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub objects: Vec<ObjectRule>,
    /// In a recipe that `extends` another: this map amends the base's map of the same
    /// direction rather than replacing it — the base's rules and objects named in `remove`
    /// are dropped, this map's rules, objects and `ignore` patterns are added, and its
    /// `config` is a merge patch (RFC 7396: `null` removes a key) of the base's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub extend: bool,
    /// With `extend`: the names (templates, as written) of the base's rules and objects to drop.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove: Vec<String>,
    /// A map for loading into a model in memory rather than writing files: it amends the
    /// map of the same direction (as `extend` does: `remove`, then its rules added) when a
    /// loader asks for the names the model's modules hold, where they differ from its files'
    /// (transformers 5 keeps a layer's experts fused in memory, `mlp.experts.gate_up_proj`,
    /// and per expert in its files). See [`Recipe::for_memory`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub memory: bool,
}

/// A non-tensor entry of the target (or a family over loop indices) and its value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectRule {
    /// The entry's name; `{EXPR}` is replaced by the expression's value (loop variables and
    /// parameters: `shard_{i}_{layers}`).
    pub name: String,
    /// Loops, as a tensor rule's.
    #[serde(default, rename = "for", skip_serializing_if = "BTreeMap::is_empty")]
    pub each: BTreeMap<String, Num>,
    /// Apply only when this expression of the parameters is true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when: Option<String>,
    /// The value (JSON: `[null]` is a list holding `None`).
    pub value: Value,
}

/// A target tensor (or a family over loop indices) and its view of the sources.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// The target's name; `{var}` is replaced by each loop variable's value.
    pub name: String,
    /// Loops: each variable runs over `0 .. count` (an expression).
    #[serde(default, rename = "for", skip_serializing_if = "BTreeMap::is_empty")]
    pub each: BTreeMap<String, Num>,
    /// Apply only when this expression of the parameters is true (`!tied`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when: Option<String>,
    /// Skip (rather than fail) when a source it reads is absent (q/k/v biases).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub optional: bool,
    /// The target's view of the sources.
    pub view: ViewTemplate,
}

/// A number of a template: a literal, or an expression of the parameters and loop variables.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Num {
    /// A literal.
    Lit(u64),
    /// An expression ([`expr`]).
    Expr(String),
}

/// A [`View`] whose names are templates and whose numbers are [`Num`]s (same JSON, same ops).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum ViewTemplate {
    /// [`View::Source`].
    Source {
        /// The source's name (a template).
        name: String,
    },
    /// [`View::Slice`].
    Slice {
        /// The operand.
        of: Box<ViewTemplate>,
        /// The dimension sliced.
        dim: usize,
        /// First index kept.
        start: Num,
        /// Number of indices kept.
        len: Num,
    },
    /// [`View::Split`].
    Split {
        /// The operand.
        of: Box<ViewTemplate>,
        /// The dimension split.
        dim: usize,
        /// The new dimensions' sizes.
        sizes: Vec<Num>,
    },
    /// [`View::Merge`].
    Merge {
        /// The operand.
        of: Box<ViewTemplate>,
        /// The first dimension merged.
        dim: usize,
        /// How many dimensions are merged.
        count: usize,
    },
    /// [`View::Permute`].
    Permute {
        /// The operand.
        of: Box<ViewTemplate>,
        /// A permutation of the operand's dimensions.
        order: Vec<usize>,
    },
    /// [`View::Concat`].
    Concat {
        /// The dimension concatenated along.
        dim: usize,
        /// The operands.
        parts: Vec<ViewTemplate>,
    },
    /// `of` for each value of one loop variable (`for`, as a rule's: `{"e": "experts"}`),
    /// stacked on a new leading axis: a fused tensor of per-index sources (transformers'
    /// in-memory `gate_up_proj` `[E, 2F, H]` from each expert's projection).
    Stack {
        /// The loop: one variable and its count.
        #[serde(rename = "for")]
        each: BTreeMap<String, Num>,
        /// The operand, rendered for each value of the variable.
        of: Box<ViewTemplate>,
    },
    /// [`View::Pad`].
    Pad {
        /// The operand.
        of: Box<ViewTemplate>,
        /// The dimension padded.
        dim: usize,
        /// Indices of fill ahead.
        #[serde(default = "zero")]
        before: Num,
        /// Indices of fill behind.
        #[serde(default = "zero")]
        after: Num,
        /// The padding's value.
        #[serde(default)]
        fill: f64,
    },
}

/// A `Num` of zero (serde's default for pads).
fn zero() -> Num {
    Num::Lit(0)
}

/// A source tensor as a recipe sees it: its name and shape.
pub type SourceShapes<'a> = HashMap<&'a str, &'a [u64]>;

/// A recipe applied: the parameters' values, and every target tensor's view of the sources.
#[derive(Clone, Debug, PartialEq)]
pub struct Instance {
    /// Every parameter's resolved value.
    pub params: BTreeMap<String, Value>,
    /// Where each value came from (`megatron: hidden_size`, `default`, `given`).
    pub origins: BTreeMap<String, String>,
    /// Target tensors in rule order: name, and view of the sources.
    pub targets: Vec<(String, View)>,
    /// The target's configuration file, rendered, if the map has one.
    pub config: Option<Value>,
    /// The target's non-tensor entries the map states: name and value.
    pub objects: Vec<(String, Value)>,
}

impl Recipe {
    /// Parse a recipe file's text; `what` names it in errors.
    pub fn from_json(text: &str, what: &str) -> Result<Recipe> {
        serde_json::from_str(text).map_err(|e| Error::usage(format!("{what}: bad recipe: {e}")))
    }

    /// This recipe over `base` (what `extends` names): the base's parameters and maps, with
    /// this recipe's own replacing those of the same name or direction.
    pub fn over(mut self, base: &Recipe) -> Recipe {
        let mut params = base.params.clone();
        params.append(&mut self.params);
        let same = |a: &Map, b: &Map| a.from == b.from && a.to == b.to && a.memory == b.memory;
        let mut maps: Vec<Map> = base
            .maps
            .iter()
            .filter(|b| !self.maps.iter().any(|m| same(m, b)))
            .cloned()
            .collect();
        for m in std::mem::take(&mut self.maps) {
            let amended = base
                .maps
                .iter()
                .find(|b| same(b, &m))
                .filter(|_| m.extend)
                .map(|b| amend(b, &m));
            maps.push(amended.unwrap_or(m));
        }
        Recipe {
            recipe: self.recipe,
            about: if self.about.is_empty() {
                base.about.clone()
            } else {
                self.about
            },
            extends: None,
            params,
            maps,
        }
    }

    /// The map from framework `from` to `to` (for files), if the recipe has one.
    pub fn map(&self, from: &str, to: &str) -> Option<&Map> {
        self.maps
            .iter()
            .find(|m| m.from == from && m.to == to && !m.memory)
    }

    /// This recipe for loading into models in memory: each map amended by its direction's
    /// [`Map::memory`] map, where there is one (its removals, then its rules).
    pub fn for_memory(&self) -> Recipe {
        let mut out = self.clone();
        let memory: Vec<Map> = self.maps.iter().filter(|m| m.memory).cloned().collect();
        out.maps.retain(|m| !m.memory);
        for mem in &memory {
            if let Some(f) = out
                .maps
                .iter_mut()
                .find(|f| f.from == mem.from && f.to == mem.to)
            {
                *f = amend(f, mem);
            }
        }
        out
    }

    /// Resolve every parameter: `given` first (on the command line), then the `from`
    /// framework's configuration (`config` looks a key up), then the default. Errors name the
    /// recipe and the parameter.
    pub fn resolve(
        &self,
        from: &str,
        config: &dyn Fn(&str) -> Option<Value>,
        given: &BTreeMap<String, Value>,
    ) -> Result<(BTreeMap<String, Value>, BTreeMap<String, String>)> {
        let name = &self.recipe;
        for k in given.keys() {
            if !self.params.contains_key(k) {
                let known: Vec<&str> = self.params.keys().map(String::as_str).collect();
                return Err(Error::usage(format!(
                    "recipe {name} has no parameter `{k}` (it has: {})",
                    known.join(", ")
                )));
            }
        }
        let mut values: BTreeMap<String, Value> = BTreeMap::new();
        let mut origins: BTreeMap<String, String> = BTreeMap::new();
        for (k, v) in given {
            values.insert(k.clone(), v.clone());
            origins.insert(k.clone(), "given".into());
        }
        for (k, p) in &self.params {
            if values.contains_key(k) {
                continue;
            }
            let Some(key) = p.from.get(from) else {
                continue;
            };
            let v = match key.strip_prefix('=') {
                // a key the configuration lacks makes the whole expression absent
                Some(e) => {
                    let lacking = std::cell::Cell::new(false);
                    let v = expr::eval(e, &|n| {
                        Some(config(n).unwrap_or_else(|| {
                            lacking.set(true);
                            Value::Null
                        }))
                    })
                    .map_err(|m| Error::usage(format!("recipe {name}: parameter {k}: {m}")))?;
                    if lacking.get() {
                        Value::Null
                    } else {
                        v
                    }
                }
                // `a|b`: the first of the keys the configuration holds
                None => key
                    .split('|')
                    .find_map(|k| config(k.trim()).filter(|v| !v.is_null()))
                    .unwrap_or(Value::Null),
            };
            if !v.is_null() {
                values.insert(k.clone(), v);
                origins.insert(
                    k.clone(),
                    format!("{from}: {}", key.trim_start_matches('=')),
                );
            }
        }
        // defaults may use other parameters: resolve in rounds until none is left
        loop {
            let pending: Vec<&String> = self
                .params
                .keys()
                .filter(|k| !values.contains_key(*k))
                .collect();
            if pending.is_empty() {
                break;
            }
            let mut progress = false;
            let mut last_err = None;
            for k in pending {
                let Some(d) = &self.params[k].default else {
                    return Err(Error::usage(format!(
                        "recipe {name}: parameter `{k}` is not in the {from} configuration and has no default: give it with --param {k}=VALUE"
                    )));
                };
                let v = match d.as_str().and_then(|s| s.strip_prefix('=')) {
                    Some(e) => match expr::eval(e, &|n| values.get(n).cloned()) {
                        Ok(v) => v,
                        Err(m) => {
                            last_err = Some(format!("parameter {k}: {m}"));
                            continue;
                        }
                    },
                    None => d.clone(),
                };
                values.insert(k.clone(), v);
                origins.insert(k.clone(), "default".into());
                progress = true;
            }
            if !progress {
                return Err(Error::usage(format!(
                    "recipe {name}: {}",
                    last_err.unwrap_or_default()
                )));
            }
        }
        Ok((values, origins))
    }

    /// Apply the map `from` → `to` to sources of these shapes with these parameter values
    /// ([`Recipe::resolve`]): every target's view, checked as the module docs say.
    pub fn instantiate(
        &self,
        from: &str,
        to: &str,
        params: BTreeMap<String, Value>,
        origins: BTreeMap<String, String>,
        sources: &SourceShapes<'_>,
    ) -> Result<Instance> {
        let name = &self.recipe;
        let map = self.map(from, to).ok_or_else(|| {
            let have: Vec<String> = self
                .maps
                .iter()
                .filter(|m| !m.memory)
                .map(|m| format!("{} → {}", m.from, m.to))
                .collect();
            Error::usage(format!(
                "recipe {name} does not convert {from} → {to} (it converts {})",
                have.join(", ")
            ))
        })?;
        let ignore =
            Ignore::new(&map.ignore).map_err(|m| Error::usage(format!("recipe {name}: {m}")))?;
        let mut targets: Vec<(String, View)> = vec![];
        let mut seen: HashSet<String> = HashSet::new();
        for rule in &map.tensors {
            let ctx = |vars: &BTreeMap<String, u64>| scope(&params, vars);
            let runs = expansions(rule.when.as_deref(), &rule.each, &params)
                .map_err(|m| Error::usage(format!("recipe {name}: {}: {m}", rule.name)))?;
            for vars in runs {
                let target = fill_in(&rule.name, &vars);
                let view = rule
                    .view
                    .render(&vars, &ctx(&vars))
                    .map_err(|m| Error::usage(format!("recipe {name}: {target}: {m}")))?;
                let view = match unstack(view, sources) {
                    Ok(v) => v,
                    Err(_) if rule.optional => continue,
                    Err(missing) => {
                        return Err(Error::layout(
                            &target,
                            format!(
                                "recipe {name} reads source tensor {missing}, which the checkpoint does not have"
                            ),
                        ))
                    }
                };
                if !seen.insert(target.clone()) {
                    return Err(Error::layout(
                        &target,
                        format!("recipe {name} defines this target tensor twice"),
                    ));
                }
                targets.push((target, view));
                if targets.len() > MAX_TARGETS {
                    return Err(Error::usage(format!(
                        "recipe {name} defines more than {MAX_TARGETS} target tensors"
                    )));
                }
            }
        }
        // every source is read, or ignored by name
        let read: HashSet<&str> = targets.iter().flat_map(|(_, v)| v.sources()).collect();
        let mut unread: Vec<&str> = sources
            .keys()
            .copied()
            .filter(|s| !read.contains(s) && !ignore.matches(s))
            .collect();
        unread.sort_unstable();
        if let Some(first) = unread.first() {
            return Err(Error::layout(
                *first,
                format!(
                    "recipe {name} ({from} → {to}) leaves this source tensor uncovered{}: no rule reads it and no `ignore` pattern names it",
                    if unread.len() > 1 {
                        format!(" (and {} more)", unread.len() - 1)
                    } else {
                        String::new()
                    }
                ),
            ));
        }
        // each view's arithmetic against the shapes, with the parameters named
        for (t, v) in &targets {
            v.shape(t, &|s| sources.get(s).map(|x| x.to_vec()))
                .map_err(|e| match e {
                    Error::Layout { tensor, msg } => Error::layout(
                        tensor,
                        format!("recipe {name}: {msg}{}", show_params(&params)),
                    ),
                    e => e,
                })?;
        }
        if map.stacked {
            targets = stack(targets, &|s| sources.get(s).map(|x| x.to_vec()))?;
        }
        let config = map
            .config
            .as_ref()
            .map(|c| render_config(c, &params))
            .transpose()
            .map_err(|m| Error::usage(format!("recipe {name}: config: {m}")))?;
        let mut objects = vec![];
        for rule in &map.objects {
            let bad = |m: String| Error::usage(format!("recipe {name}: object {}: {m}", rule.name));
            for vars in expansions(rule.when.as_deref(), &rule.each, &params).map_err(bad)? {
                let n = render_name(&rule.name, &scope(&params, &vars)).map_err(bad)?;
                objects.push((n, rule.value.clone()));
                if objects.len() > MAX_TARGETS {
                    return Err(bad("too many".into()));
                }
            }
        }
        Ok(Instance {
            params,
            origins,
            targets,
            config,
            objects,
        })
    }
}

/// `; parameters: a=1, b=2` for an error about shapes.
fn show_params(params: &BTreeMap<String, Value>) -> String {
    let shown: Vec<String> = params
        .iter()
        .filter(|(_, v)| v.is_number())
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    format!(" (parameters: {})", shown.join(", "))
}

/// The `ignore` patterns of a map: globs over dot-separated names, where `*` does not cross a
/// `.` and `**` does.
struct Ignore(globset::GlobSet);

impl Ignore {
    /// Compile the patterns; `Err` names a bad one.
    fn new(patterns: &[String]) -> std::result::Result<Ignore, String> {
        let mut b = globset::GlobSetBuilder::new();
        for p in patterns {
            let g = globset::GlobBuilder::new(&Ignore::as_path(p))
                .literal_separator(true)
                .build()
                .map_err(|e| format!("bad ignore pattern `{p}`: {e}"))?;
            b.add(g);
        }
        b.build().map(Ignore).map_err(|e| e.to_string())
    }

    /// A name as globset sees it: `.` is the separator (and a `/` in a name is not one).
    fn as_path(name: &str) -> String {
        name.replace('/', "\u{1}").replace('.', "/")
    }

    /// Whether a pattern names `name`.
    fn matches(&self, name: &str) -> bool {
        self.0.is_match(Ignore::as_path(name))
    }
}

/// The names an expression of a rule sees: its loop variables, then the parameters.
fn scope<'a>(
    params: &'a BTreeMap<String, Value>,
    vars: &BTreeMap<String, u64>,
) -> impl Fn(&str) -> Option<Value> + 'a {
    let vars = vars.clone();
    move |n: &str| {
        vars.get(n)
            .map(|v| Value::from(*v))
            .or_else(|| params.get(n).cloned())
    }
}

/// The loop variables' values a rule runs for: none when its `when` is false, else every
/// combination of its `for` loops ([`loops`]).
fn expansions(
    when: Option<&str>,
    each: &BTreeMap<String, Num>,
    params: &BTreeMap<String, Value>,
) -> std::result::Result<Vec<BTreeMap<String, u64>>, String> {
    let top = scope(params, &BTreeMap::new());
    if let Some(w) = when {
        if !expr::eval_bool(w, &top).map_err(|m| format!("when: {m}"))? {
            return Ok(vec![]);
        }
    }
    loops(each, &top).map_err(|m| format!("for: {m}"))
}

/// Every combination of the loop variables' values (variables in name order, the last
/// fastest).
fn loops(
    each: &BTreeMap<String, Num>,
    ctx: &dyn Fn(&str) -> Option<Value>,
) -> std::result::Result<Vec<BTreeMap<String, u64>>, String> {
    let mut out = vec![BTreeMap::new()];
    for (var, count) in each {
        let n = count.eval(ctx)?;
        if (out.len() as u64).saturating_mul(n) > MAX_TARGETS as u64 {
            return Err(format!("{var} runs over {n} values: too many"));
        }
        out = out
            .into_iter()
            .flat_map(|m| {
                (0..n).map(move |i| {
                    let mut m = m.clone();
                    m.insert(var.clone(), i);
                    m
                })
            })
            .collect();
    }
    Ok(out)
}

/// `template` with each `{var}` replaced by its value.
fn fill_in(template: &str, vars: &BTreeMap<String, u64>) -> String {
    let mut s = template.to_string();
    for (k, v) in vars {
        s = s.replace(&format!("{{{k}}}"), &v.to_string());
    }
    s
}

/// `template` with each `{EXPR}` replaced by the expression's value.
fn render_name(
    template: &str,
    ctx: &dyn Fn(&str) -> Option<Value>,
) -> std::result::Result<String, String> {
    let mut out = String::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let close = rest[open..]
            .find('}')
            .ok_or_else(|| format!("`{template}`: a `{{` without its `}}`"))?;
        out.push_str(&rest[..open]);
        let v = expr::eval(&rest[open + 1..open + close], ctx)?;
        match v {
            Value::String(s) => out.push_str(&s),
            v => out.push_str(&v.to_string()),
        }
        rest = &rest[open + close + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

impl Num {
    /// The number's value.
    pub fn eval(&self, ctx: &dyn Fn(&str) -> Option<Value>) -> std::result::Result<u64, String> {
        match self {
            Num::Lit(n) => Ok(*n),
            Num::Expr(e) => expr::eval_u64(e, ctx),
        }
    }
}

impl ViewTemplate {
    /// The view with names filled in and numbers evaluated.
    pub fn render(
        &self,
        vars: &BTreeMap<String, u64>,
        ctx: &dyn Fn(&str) -> Option<Value>,
    ) -> std::result::Result<View, String> {
        let r = |t: &ViewTemplate| t.render(vars, ctx);
        let n = |x: &Num| x.eval(ctx);
        Ok(match self {
            ViewTemplate::Source { name } => View::source(fill_in(name, vars)),
            ViewTemplate::Slice {
                of,
                dim,
                start,
                len,
            } => r(of)?.slice(*dim, n(start)?, n(len)?),
            ViewTemplate::Split { of, dim, sizes } => {
                let sizes = sizes
                    .iter()
                    .map(n)
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                r(of)?.split(*dim, &sizes)
            }
            ViewTemplate::Merge { of, dim, count } => r(of)?.merge(*dim, *count),
            ViewTemplate::Permute { of, order } => r(of)?.permute(order),
            ViewTemplate::Concat { dim, parts } => View::concat(
                *dim,
                parts.iter().map(r).collect::<std::result::Result<_, _>>()?,
            ),
            ViewTemplate::Stack { each, of } => {
                let [(var, count)] = each.iter().collect::<Vec<_>>()[..] else {
                    return Err(format!(
                        "a stack loops over one variable, not {}",
                        each.len()
                    ));
                };
                let count = n(count)?;
                if count == 0 {
                    return Err(format!("a stack over `{var}` of 0 operands"));
                }
                let mut parts = Vec::with_capacity(count as usize);
                for k in 0..count {
                    let mut inner = vars.clone();
                    inner.insert(var.clone(), k);
                    let scoped = |name: &str| {
                        if name == var {
                            Some(Value::from(k))
                        } else {
                            ctx(name)
                        }
                    };
                    parts.push(of.render(&inner, &scoped)?.merge(0, 0));
                }
                View::concat(0, parts)
            }
            ViewTemplate::Pad {
                of,
                dim,
                before,
                after,
                fill,
            } => r(of)?.pad(*dim, n(before)?, n(after)?, *fill),
        })
    }
}

/// `name` with its all-digit segments removed, and those indices in order
/// (`decoder.layers.3.mlp` → `decoder.layers.mlp`, `[3]`).
pub fn stacked_name(name: &str) -> (String, Vec<u64>) {
    let mut idx = vec![];
    let kept: Vec<&str> = name
        .split('.')
        .filter(|seg| match seg.parse::<u64>() {
            Ok(i) if !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_digit()) => {
                idx.push(i);
                false
            }
            _ => true,
        })
        .collect();
    (kept.join("."), idx)
}

/// Replace each source the checkpoint lacks by the slice of its stacked tensor; `Err` names
/// a source found neither way.
fn unstack(view: View, sources: &SourceShapes<'_>) -> std::result::Result<View, String> {
    let mut missing = None;
    let out = view.map_sources(&mut |name| {
        if sources.contains_key(name) {
            return View::source(name);
        }
        let (stacked, idx) = stacked_name(name);
        match sources.get(stacked.as_str()) {
            Some(shape)
                if !idx.is_empty()
                    && shape.len() > idx.len()
                    && idx.iter().zip(shape.iter()).all(|(i, n)| i < n) =>
            {
                let mut v = View::source(stacked);
                for &i in &idx {
                    // take index i of the leading axis, then drop the axis
                    v = v.slice(0, i, 1).split(0, &[]);
                }
                v
            }
            _ => {
                missing.get_or_insert_with(|| name.to_string());
                View::source(name)
            }
        }
    });
    match missing {
        Some(m) => Err(m),
        None => Ok(out),
    }
}

/// `base` amended by `m`: the rules and objects `m.remove` names dropped, `m`'s rules,
/// objects and `ignore` patterns added, and its `config` a merge patch of the base's.
fn amend(base: &Map, m: &Map) -> Map {
    let mut b = base.clone();
    b.tensors.retain(|r| !m.remove.contains(&r.name));
    b.objects.retain(|o| !m.remove.contains(&o.name));
    b.tensors.extend(m.tensors.iter().cloned());
    b.objects.extend(m.objects.iter().cloned());
    b.ignore.extend(m.ignore.iter().cloned());
    if let Some(patch) = &m.config {
        let mut c = b.config.take().unwrap_or(Value::Object(Default::default()));
        merge_patch(&mut c, patch);
        b.config = Some(c);
    }
    b
}

/// Group targets whose names hold index segments into stacked tensors: each stack is the
/// `Concat` of its members along new leading axes (one per index segment, outermost first);
/// the indices of each stack must run densely from 0. `shape_of` gives the sources' shapes.
pub fn stack(
    targets: Vec<(String, View)>,
    shape_of: &dyn Fn(&str) -> Option<Vec<u64>>,
) -> Result<Vec<(String, View)>> {
    // stacked name → (indices, view), first-seen order of stacks
    let mut order: Vec<String> = vec![];
    let mut groups: HashMap<String, Vec<(Vec<u64>, View)>> = HashMap::new();
    let mut out: Vec<(String, View)> = vec![];
    for (name, view) in targets {
        let (s, idx) = stacked_name(&name);
        if idx.is_empty() {
            out.push((name, view));
            continue;
        }
        if !groups.contains_key(&s) {
            order.push(s.clone());
        }
        groups.entry(s).or_default().push((idx, view));
    }
    for s in order {
        let mut members = groups.remove(&s).expect("grouped");
        members.sort_by(|a, b| a.0.cmp(&b.0));
        let depth = members[0].0.len();
        if members.iter().any(|(i, _)| i.len() != depth) {
            return Err(Error::layout(
                &s,
                "stacked from names with different numbers of index segments",
            ));
        }
        let shape = members[0].1.shape(&s, shape_of)?;
        for (i, v) in &members {
            if v.shape(&s, shape_of)? != shape {
                return Err(Error::layout(
                    &s,
                    format!("stacked from tensors of different shapes (index {i:?})"),
                ));
            }
        }
        out.push((s.clone(), nest(&s, &members, 0)?));
    }
    Ok(out)
}

/// The stack of `members` (sorted, all sharing `members[0].0[..level]`) from index level
/// `level` down.
fn nest(name: &str, members: &[(Vec<u64>, View)], level: usize) -> Result<View> {
    if level == members[0].0.len() {
        return Ok(members[0].1.clone());
    }
    let mut parts = vec![];
    let mut at = 0;
    let mut next = 0u64;
    while at < members.len() {
        let i = members[at].0[level];
        if i != next {
            return Err(Error::layout(
                name,
                format!("stacked from indices that skip {next} (at segment {level})"),
            ));
        }
        let end = at
            + members[at..]
                .iter()
                .take_while(|(m, _)| m[level] == i)
                .count();
        parts.push(nest(name, &members[at..end], level + 1)?.merge(0, 0));
        at = end;
        next += 1;
    }
    Ok(View::concat(0, parts))
}

/// A configuration template rendered: strings `=EXPR` evaluated over the parameters.
fn render_config(
    t: &Value,
    params: &BTreeMap<String, Value>,
) -> std::result::Result<Value, String> {
    Ok(match t {
        Value::String(s) => match s.strip_prefix('=') {
            Some(e) => {
                expr::eval(e, &|n| params.get(n).cloned()).map_err(|m| format!("{s}: {m}"))?
            }
            None => t.clone(),
        },
        Value::Array(a) => Value::Array(
            a.iter()
                .map(|x| render_config(x, params))
                .collect::<std::result::Result<_, _>>()?,
        ),
        Value::Object(o) => {
            let mut m = serde_json::Map::new();
            for (k, v) in o {
                m.insert(k.clone(), render_config(v, params)?);
            }
            Value::Object(m)
        }
        _ => t.clone(),
    })
}

/// Apply a JSON merge patch (RFC 7396) to `target`: objects merge key by key, `null` removes.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Default::default());
    }
    let t = target.as_object_mut().expect("an object");
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A recipe with a files map (per-expert targets) and a memory map (the experts fused).
    fn experts_recipe() -> Recipe {
        Recipe::from_json(
            r#"{"recipe": "t", "params": {"experts": {"default": 3}},
                "maps": [
                  {"from": "a", "to": "b", "tensors": [
                    {"name": "x.{e}", "for": {"e": "experts"}, "view": {"op": "source", "name": "w.{e}"}},
                    {"name": "keep", "view": {"op": "source", "name": "k"}}]},
                  {"from": "a", "to": "b", "memory": true, "remove": ["x.{e}"], "tensors": [
                    {"name": "fused", "view": {"op": "stack", "for": {"e": "experts"},
                                               "of": {"op": "source", "name": "w.{e}"}}}]}]}"#,
            "test",
        )
        .unwrap()
    }

    fn targets(r: &Recipe) -> Vec<(String, Vec<u64>)> {
        let shapes: Vec<(String, Vec<u64>)> = ["w.0", "w.1", "w.2", "k"]
            .iter()
            .map(|n| (n.to_string(), vec![4, 2]))
            .collect();
        let sources: SourceShapes<'_> = shapes
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_slice()))
            .collect();
        let (params, origins) = r.resolve("a", &|_| None, &BTreeMap::new()).unwrap();
        let inst = r.instantiate("a", "b", params, origins, &sources).unwrap();
        let shape_of = |n: &str| shapes.iter().find(|(m, _)| m == n).map(|(_, s)| s.clone());
        inst.targets
            .iter()
            .map(|(n, v)| (n.clone(), v.shape(n, &shape_of).unwrap()))
            .collect()
    }

    #[test]
    fn a_memory_map_amends_its_direction_only_for_loaders() {
        let r = experts_recipe();
        // files: the memory map is not a second map of the direction
        let files = targets(&r);
        let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["x.0", "x.1", "x.2", "keep"]);
        // in memory: the per-expert rule removed, the stack added (3 experts of [4, 2])
        let memory = targets(&r.for_memory());
        assert_eq!(
            memory,
            [
                ("keep".to_string(), vec![4, 2]),
                ("fused".to_string(), vec![3, 4, 2])
            ]
        );
    }

    #[test]
    fn a_stack_loops_over_exactly_one_variable() {
        let t: ViewTemplate = serde_json::from_str(
            r#"{"op": "stack", "for": {"a": 2, "b": 2}, "of": {"op": "source", "name": "w"}}"#,
        )
        .unwrap();
        let err = t.render(&BTreeMap::new(), &|_| None).unwrap_err();
        assert!(err.contains("one variable, not 2"), "{err}");
        let t: ViewTemplate = serde_json::from_str(
            r#"{"op": "stack", "for": {"e": 2}, "of": {"op": "source", "name": "w.{e}"}}"#,
        )
        .unwrap();
        let v = t.render(&BTreeMap::new(), &|_| None).unwrap();
        assert_eq!(v.sources(), ["w.0", "w.1"]);
    }
}
