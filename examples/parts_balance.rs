//! How a conversion's destination bytes split over N workers ([`reshard::parts::split`]):
//! prepares the conversion (nothing is written) and prints each part's bytes and the
//! largest part against the mean.
//!
//! ```text
//! cargo run --release --example parts_balance -- SRC M FORMAT N
//! cargo run --release --example parts_balance -- tests/fixtures/fsdp2_w4_f32/checkpoint 8 dcp 64
//! ```

use reshard::convert::{prepare, ConvertOptions};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [src, m, format, n] = args.as_slice() else {
        eprintln!("usage: parts_balance SRC M FORMAT N");
        std::process::exit(2);
    };
    let (Ok(m), Ok(n), Ok(format)) = (m.parse::<u64>(), n.parse::<u32>(), format.parse()) else {
        eprintln!("parts_balance: M and N are numbers, FORMAT a format name");
        std::process::exit(2);
    };
    let mut opts = ConvertOptions::to(m);
    opts.format = Some(format);
    opts.per_rank = Some(reshard::per_rank::Policy::Keep);
    let job = match prepare(src, None, &opts) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("parts_balance: {e}");
            std::process::exit(1);
        }
    };
    let sizes: Vec<u64> = job.output_files().iter().map(|f| f.1).collect();
    let parts = match reshard::parts::split(&sizes, &job.plan, n) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("parts_balance: {e}");
            std::process::exit(1);
        }
    };
    let loads: Vec<u64> = parts
        .iter()
        .map(|p| p.iter().map(|s| s.len()).sum())
        .collect();
    let total: u64 = loads.iter().sum();
    let mean = total as f64 / n as f64;
    let max = *loads.iter().max().unwrap_or(&0);
    let min = *loads.iter().min().unwrap_or(&0);
    let spans: usize = parts.iter().map(Vec::len).sum();
    println!(
        "{} output files, {total} bytes, {n} parts, {spans} spans: largest part {max} bytes \
         ({:.3}x the mean), smallest {min} ({:.3}x)",
        sizes.len(),
        max as f64 / mean,
        min as f64 / mean
    );
}
