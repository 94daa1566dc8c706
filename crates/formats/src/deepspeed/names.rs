//! The file names of a ZeRO checkpoint's tag folder, parsed and made.

/// What a file of the tag folder is, by its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `mp_rank_<mp>_model_states.pt` (stages 1 and 2: one for all data-parallel ranks).
    ModelStates {
        /// Model-parallel rank.
        mp: u64,
    },
    /// `zero_pp_rank_<r>_mp_rank_<mp>_model_states.pt` (stage 3: one per rank).
    RankModelStates {
        /// Data-parallel rank.
        rank: u64,
        /// Model-parallel rank.
        mp: u64,
    },
    /// `[bf16_]zero_pp_rank_<r>_mp_rank_<mp>_optim_states.pt`.
    Optim {
        /// Data-parallel rank.
        rank: u64,
        /// Model-parallel rank.
        mp: u64,
        /// Written by a bf16 engine (`bf16_` prefix).
        bf16: bool,
    },
    /// A file of a layout reshard does not read: pipeline-parallel layers
    /// (`layer_<i>-model_<mp>-model_states.pt`) or mixture-of-experts states
    /// (`expert_*`, `expp_rank_*`).
    Unsupported(&'static str),
}

/// A decimal number of at most 9 digits (ranks; longer is not a rank).
fn number(s: &str) -> Option<u64> {
    (!s.is_empty() && s.len() <= 9 && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse().ok())
        .flatten()
}

/// `zero_pp_rank_<r>_mp_rank_<mp>` → (r, mp).
fn ranks(s: &str) -> Option<(u64, u64)> {
    let rest = s.strip_prefix("zero_pp_rank_")?;
    let (r, mp) = rest.split_once("_mp_rank_")?;
    Some((number(r)?, number(mp)?))
}

/// What the file called `name` is; `None` for a file that is not part of a ZeRO checkpoint.
pub fn kind(name: &str) -> Option<Kind> {
    if let Some(stem) = name.strip_suffix("_model_states.pt") {
        if let Some(mp) = stem.strip_prefix("mp_rank_") {
            return Some(match number(mp) {
                Some(mp) => Kind::ModelStates { mp },
                None => Kind::Unsupported("an unknown model states file"),
            });
        }
        if let Some((rank, mp)) = ranks(stem) {
            return Some(Kind::RankModelStates { rank, mp });
        }
    }
    if let Some(stem) = name
        .strip_suffix("_optim_states.pt")
        .or_else(|| name.strip_suffix("optim_states.pt"))
    {
        let (bf16, stem) = match stem.strip_prefix("bf16_") {
            Some(s) => (true, s),
            None => (false, stem),
        };
        if let Some((rank, mp)) = ranks(stem) {
            return Some(Kind::Optim { rank, mp, bf16 });
        }
    }
    if name.ends_with("model_states.pt") && name.starts_with("layer_") {
        return Some(Kind::Unsupported(
            "pipeline-parallel layer files (layer_*-model_states.pt)",
        ));
    }
    if name.ends_with(".pt") && (name.starts_with("expert_") || name.starts_with("expp_rank_")) {
        return Some(Kind::Unsupported("mixture-of-experts files"));
    }
    None
}

/// The model states file of stages 1 and 2.
pub fn model_states() -> String {
    "mp_rank_00_model_states.pt".to_string()
}

/// Rank `rank`'s model states file at stage 3.
pub fn rank_model_states(rank: u64) -> String {
    format!("zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
}

/// Rank `rank`'s optim states file (`bf16`: of a bf16 engine).
pub fn optim_states(rank: u64, bf16: bool) -> String {
    format!(
        "{}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
        if bf16 { "bf16_" } else { "" }
    )
}

/// True for a tag (the folder name `latest` holds) that is one plain path component.
pub fn is_plain_tag(tag: &str) -> bool {
    !tag.is_empty()
        && tag.len() <= 255
        && tag != "."
        && tag != ".."
        && !tag.contains(['/', '\\', '\0'])
        && !tag.chars().any(char::is_control)
}

/// The tag a `latest` (or `latest_universal`) file names: its text, trimmed, checked to be
/// one plain folder name. Refused, naming the file: more than 4 KiB, or not a tag.
pub fn read_tag_file(file: &std::path::Path) -> crate::error::Result<String> {
    use crate::error::{Error, IoContext};
    if std::fs::metadata(file).at(file)?.len() > 4096 {
        return Err(Error::format(file, "is too long to hold a tag"));
    }
    let text = std::fs::read(file).at(file)?;
    let tag = String::from_utf8_lossy(&text).trim().to_string();
    if !is_plain_tag(&tag) {
        return Err(Error::format(
            file,
            format!(
                "holds `{}`, not a checkpoint tag (a folder name)",
                crate::torch::short(&tag)
            ),
        ));
    }
    Ok(tag)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        assert_eq!(kind(&model_states()), Some(Kind::ModelStates { mp: 0 }));
        assert_eq!(
            kind(&rank_model_states(12)),
            Some(Kind::RankModelStates { rank: 12, mp: 0 })
        );
        assert_eq!(
            kind(&optim_states(3, true)),
            Some(Kind::Optim {
                rank: 3,
                mp: 0,
                bf16: true
            })
        );
        assert_eq!(
            kind("zero_pp_rank_1_mp_rank_00optim_states.pt"),
            Some(Kind::Optim {
                rank: 1,
                mp: 0,
                bf16: false
            })
        );
        assert_eq!(
            kind("zero_pp_rank_0_mp_rank_01_optim_states.pt"),
            Some(Kind::Optim {
                rank: 0,
                mp: 1,
                bf16: false
            })
        );
        assert!(matches!(
            kind("layer_01-model_00-model_states.pt"),
            Some(Kind::Unsupported(_))
        ));
        assert!(matches!(
            kind("expp_rank_0_mp_rank_00_optim_states.pt"),
            Some(Kind::Unsupported(_))
        ));
        assert_eq!(kind("zero_pp_rank_x_mp_rank_00_optim_states.pt"), None);
        assert_eq!(kind("latest"), None);
        assert!(is_plain_tag("global_step2"));
        for bad in ["", "..", "a/b", "x\ny", "."] {
            assert!(!is_plain_tag(bad), "{bad:?}");
        }
    }
}
