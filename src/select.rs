//! Choosing and renaming entries: which tensors and non-tensor entries a conversion or a
//! loader keeps (include/exclude globs, `*` crossing dots), and the names they get.

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::layout::TensorLayout;
use globset::{Glob, GlobSet, GlobSetBuilder};

/// Which tensors to keep: names matching any `include` glob (all when empty) and no
/// `exclude` glob (`*` matches across dots); and how kept names are renamed: `strip_prefix`
/// is removed where a name starts with it, then `add_prefix` is put in front.
#[derive(Clone, Debug, Default)]
pub struct Selection {
    /// Globs of names to keep.
    pub include: Vec<String>,
    /// Globs of names to drop.
    pub exclude: Vec<String>,
    /// Prefix removed from names that start with it.
    pub strip_prefix: Option<String>,
    /// Prefix added to every name.
    pub add_prefix: Option<String>,
}

fn globset(globs: &[String]) -> Result<GlobSet> {
    let mut b = GlobSetBuilder::new();
    for g in globs {
        b.add(Glob::new(g).map_err(|e| Error::usage(format!("bad glob `{g}`: {e}")))?);
    }
    b.build().map_err(|e| Error::usage(e.to_string()))
}

impl Selection {
    /// The output name of `name`.
    pub fn rename(&self, name: &str) -> String {
        let stripped = match &self.strip_prefix {
            Some(p) => name.strip_prefix(p.as_str()).unwrap_or(name),
            None => name,
        };
        format!("{}{stripped}", self.add_prefix.as_deref().unwrap_or(""))
    }

    /// Rename `names`, refusing two names that would become one.
    pub fn rename_all<'a>(&self, names: impl Iterator<Item = &'a str>) -> Result<Vec<String>> {
        let mut seen: std::collections::HashMap<String, &str> = Default::default();
        let mut out = vec![];
        for n in names {
            let r = self.rename(n);
            if r.is_empty() {
                return Err(Error::usage(format!(
                    "`{n}` would be renamed to an empty name"
                )));
            }
            if let Some(prev) = seen.insert(r.clone(), n) {
                return Err(Error::usage(format!(
                    "`{prev}` and `{n}` would both be named `{r}`"
                )));
            }
            out.push(r);
        }
        Ok(out)
    }

    /// Check the include and exclude globs are valid patterns.
    pub fn check(&self) -> Result<()> {
        globset(&self.include)?;
        globset(&self.exclude)?;
        Ok(())
    }

    /// True when `name` passes the include and exclude globs.
    pub fn keeps(&self, name: &str) -> bool {
        let inc = self.include.is_empty() || globset(&self.include).is_ok_and(|g| g.is_match(name));
        inc && !globset(&self.exclude).is_ok_and(|g| g.is_match(name))
    }

    /// The names of `ck`'s tensors that are selected, in checkpoint order.
    pub fn apply<'a>(&self, ck: &'a Checkpoint) -> Result<Vec<&'a TensorLayout>> {
        let inc = globset(&self.include)?;
        let exc = globset(&self.exclude)?;
        let v: Vec<_> = ck
            .tensors
            .iter()
            .filter(|t| {
                (self.include.is_empty() || inc.is_match(&t.name)) && !exc.is_match(&t.name)
            })
            .collect();
        if v.is_empty() && !ck.tensors.is_empty() {
            return Err(Error::usage(format!(
                "no tensor of {} matches the include/exclude patterns",
                ck.path.display()
            )));
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renaming_strips_adds_and_refuses_collisions() {
        let sel = Selection {
            strip_prefix: Some("model.".into()),
            add_prefix: Some("s.".into()),
            ..Default::default()
        };
        assert_eq!(sel.rename("model.w"), "s.w");
        assert_eq!(sel.rename("opt.w"), "s.opt.w");
        let sel = Selection {
            strip_prefix: Some("a.".into()),
            ..Default::default()
        };
        let e = sel
            .rename_all(["a.x", "x"].into_iter())
            .unwrap_err()
            .to_string();
        assert_eq!(e, "`a.x` and `x` would both be named `x`");
    }
}
