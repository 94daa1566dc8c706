//! The flat tensors of the output and the flat-partition arithmetic that places each
//! parameter in them: per parameter group at stages 1 and 2 (alignment paddings, round-robin
//! order, the slices `param_slice_mappings` records), per sub-group of chunks at stage 3.

use super::super::partition::{self, FlatGroup, Span};
use super::job::Kind;
use super::Writer;

/// One flat tensor of the output (a parameter group at stages 1 and 2, a sub-group at 3):
/// its parameter group, its parameters (indices into the group) and their runs.
pub(super) struct Flat {
    pub(super) group: usize,
    pub(super) params: Vec<(String, Vec<u64>, Vec<Span>)>,
    /// Elements of every rank's fp32 tensor (stage 1/2: the partition; 3: the chunks).
    pub(super) len: u64,
    /// Stages 1 and 2: the group's layout.
    pub(super) layout: Option<FlatGroup>,
    /// Indices into `params` in the group's own order (the flattening order but under
    /// `round_robin_gradients`).
    pub(super) mapping_order: Vec<usize>,
    /// Stages 1 and 2: per parameter (flattening order), the runs `param_slice_mappings`
    /// records, as DeepSpeed computes them ([`partition::recorded_slices`]).
    pub(super) recorded: Vec<Vec<Span>>,
}

impl Writer<'_> {
    /// The flat tensors at M ranks.
    pub(super) fn flats(&self) -> Vec<Flat> {
        let mut out = vec![];
        for (g, params) in self.job.groups.iter().enumerate() {
            match self.job.kind {
                Kind::Zero3 => out.extend(self.sub_group_flats(g, params)),
                Kind::Zero12(_) | Kind::Bf16 => out.push(self.group_flat(g, params)),
            }
        }
        out
    }

    /// Stage 3: group `g`'s parameters chunked over the ranks, their chunks in order through
    /// the flat tensor of each sub-group.
    fn sub_group_flats(&self, g: usize, params: &[(String, Vec<u64>)]) -> Vec<Flat> {
        let numels: Vec<u64> = params.iter().map(|(_, s)| s.iter().product()).collect();
        let chunks: Vec<u64> = numels
            .iter()
            .map(|&n| partition::chunk(n, self.m))
            .collect();
        let mut out = vec![];
        let mut at_param = 0;
        for n in partition::sub_groups(&chunks, self.job.sub_group_size) {
            let mut at = 0u64;
            let mut ps = vec![];
            for i in at_param..at_param + n {
                let (name, shape) = &params[i];
                ps.push((
                    name.clone(),
                    shape.clone(),
                    partition::chunk_spans(numels[i], chunks[i], self.m, at),
                ));
                at += chunks[i];
            }
            at_param += n;
            let mapping_order = (0..ps.len()).collect();
            out.push(Flat {
                group: g,
                params: ps,
                len: at,
                layout: None,
                mapping_order,
                recorded: vec![],
            });
        }
        out
    }

    /// Stages 1 and 2: group `g`'s parameters flattened (in round-robin order under
    /// `round_robin_gradients`, aligned under `parameter_alignment`) and partitioned over
    /// the ranks.
    fn group_flat(&self, g: usize, params: &[(String, Vec<u64>)]) -> Flat {
        let numels: Vec<u64> = params.iter().map(|(_, s)| s.iter().product()).collect();
        // round_robin_gradients flattens the group in DeepSpeed's order at M
        let own = if self.job.round_robin && self.job.kind != Kind::Bf16 {
            partition::round_robin(params.len(), self.m)
        } else {
            (0..params.len()).collect()
        };
        let params: Vec<&(String, Vec<u64>)> = own.iter().map(|&i| &params[i]).collect();
        let numels: Vec<u64> = own.iter().map(|&i| numels[i]).collect();
        let paddings = self.alignment_paddings(&numels);
        let layout = FlatGroup {
            numels,
            paddings,
            dp: self.m,
        };
        let ps = params
            .iter()
            .zip(layout.all_spans())
            .map(|((n, s), spans)| (n.clone(), s.clone(), spans))
            .collect();
        let recorded = partition::recorded_slices(&layout, &own);
        // the group's own order, in which DeepSpeed lists the slice mappings
        let mut mapping_order = vec![0; own.len()];
        for (j, &i) in own.iter().enumerate() {
            mapping_order[i] = j;
        }
        Flat {
            group: g,
            params: ps,
            len: layout.partition_size(),
            layout: Some(layout),
            mapping_order,
            recorded,
        }
    }

    /// The padding after each parameter of a group of `numels` (flattening order): DeepSpeed
    /// aligns each parameter but the last to 16 bytes of the model dtype when
    /// parameter_alignment is on (stage 1/2 optimizer only).
    fn alignment_paddings(&self, numels: &[u64]) -> Vec<u64> {
        let align = if self.job.parameter_alignment && self.job.kind != Kind::Bf16 {
            let e = self.job.model_dtype.size() as u64;
            16 / gcd(16, e)
        } else {
            1
        };
        let mut paddings = vec![];
        let mut at = 0u64;
        for (i, n) in numels.iter().enumerate() {
            at += n;
            let p = if i + 1 == numels.len() {
                0
            } else {
                (align - at % align) % align
            };
            paddings.push(p);
            at += p;
        }
        paddings
    }
}

/// The greatest common divisor.
fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}
