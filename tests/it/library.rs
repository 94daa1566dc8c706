//! The library as a trainer uses it: open a checkpoint and read any region of any tensor.

use crate::common::*;
use reshard::formats::Checkpoint;
use reshard::layout::{DType, Region};

#[test]
fn read_region_returns_exactly_the_slice() {
    let (_d, ck) = synthetic(4);
    let m = model();
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

#[test]
fn read_array_gives_typed_ndarrays() {
    let (_d, ck) = synthetic(3);
    let m = model();
    let c = Checkpoint::open(&ck).unwrap();
    let t = &m["model.embed.weight"];
    let a = c
        .read_array::<f32>("model.embed.weight", &Region::new(vec![1, 2], vec![8, 4]))
        .unwrap();
    assert_eq!(a.shape(), &[8, 4]);
    for i in 0..8 {
        for j in 0..4 {
            let k = ((1 + i) * 12 + 2 + j) * 4;
            assert_eq!(
                a[[i, j]].to_bits(),
                f32::from_le_bytes(t.data[k..k + 4].try_into().unwrap()).to_bits()
            );
        }
    }
    let ids = c
        .read_array::<i64>("model.ids", &Region::new(vec![0, 0], vec![11, 2]))
        .unwrap();
    assert_eq!(
        ids[[10, 1]],
        i64::from_le_bytes(m["model.ids"].data[168..176].try_into().unwrap())
    );
    // bf16 read as f32 converts; an integer tensor cannot be read as f32
    let q = c
        .read_array::<f32>(
            "model.blocks.0.qkv.weight",
            &Region::new(vec![0, 0], vec![1, 1]),
        )
        .unwrap();
    let b = &m["model.blocks.0.qkv.weight"].data;
    assert_eq!(
        q[[0, 0]],
        half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
    );
    assert!(c
        .read_array::<f32>("model.ids", &Region::new(vec![0, 0], vec![1, 1]))
        .is_err());
}
