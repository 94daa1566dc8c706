//! The library as a trainer uses it: open a checkpoint and read any region of any tensor.

mod common;
use common::*;
use reshard::formats::Checkpoint;
use reshard::layout::{DType, Region};

#[test]
fn read_region_returns_exactly_the_slice() {
    let d = tempfile::tempdir().unwrap();
    let ck = d.path().join("ck");
    let m = model();
    write_hf_storage(&ck, &fsdp_shards(&m, 4));
    let c = Checkpoint::open(&ck).unwrap();
    // every row range of every 2-d tensor, compared with the rows of the full tensor
    for (name, t) in &m {
        if t.shape.len() != 2 {
            continue;
        }
        for a in 0..t.shape[0] {
            for b in a..=t.shape[0] {
                let r = Region::new(vec![a as u64, 0], vec![(b - a) as u64, t.shape[1] as u64]);
                assert_eq!(
                    c.read_region(name, &r, None).unwrap(),
                    rows(t, a, b),
                    "{name} rows {a}..{b}"
                );
            }
        }
    }
    // a column block of embed: rows 2..9, columns 5..8
    let t = &m["model.embed.weight"];
    let got = c
        .read_region(
            "model.embed.weight",
            &Region::new(vec![2, 5], vec![7, 3]),
            None,
        )
        .unwrap();
    let want: Vec<u8> = (2..9)
        .flat_map(|i| t.data[(i * 12 + 5) * 4..(i * 12 + 8) * 4].to_vec())
        .collect();
    assert_eq!(got, want);
    // a scalar, converted
    let step = c
        .read_region("opt.step", &Region::new(vec![], vec![]), Some(DType::F64))
        .unwrap();
    let v = f32::from_le_bytes(m["opt.step"].data[..4].try_into().unwrap());
    assert_eq!(
        f64::from_le_bytes(step.try_into().unwrap()).to_bits(),
        (v as f64).to_bits()
    );
    assert!(c
        .read_region("model.cls", &Region::new(vec![2, 0], vec![2, 12]), None)
        .is_err());
    assert!(c
        .read_region("nope", &Region::new(vec![], vec![]), None)
        .is_err());
}
