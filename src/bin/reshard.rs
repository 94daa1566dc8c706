//! `reshard`: the command-line tool. All of it lives in the library's `cli` module, which the
//! Python package's `reshard` command runs too.

fn main() -> std::process::ExitCode {
    reshard::cli::main(std::env::args_os()).into()
}
