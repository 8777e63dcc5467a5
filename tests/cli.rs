//! The examples' option parser (examples/support/cli.rs, included here by
//! path): unknown options, missing values and stray arguments are errors
//! naming the option, where the old lookup ignored or swallowed them.

#[path = "../examples/support/cli.rs"]
mod cli;

fn parse(args: &[&str]) -> Result<cli::Args, String> {
    let extra = [cli::flag("batchnorm", "b"), cli::value("hidden", "K", "k")];
    cli::parse_from("usage", &extra, args.iter().map(|a| a.into()))
}

#[test]
fn unknown_options_are_errors() {
    // `--epoch 1` once ran the default 30 epochs.
    let e = parse(&["--epoch", "1"]).err().unwrap();
    assert!(e.contains("unknown option --epoch"), "{e}");
}

#[test]
fn a_missing_value_is_an_error_and_never_swallows_the_next_option() {
    let e = parse(&["--save"]).err().unwrap();
    assert!(e.contains("--save"), "{e}");
    // `--save --epochs 3` once saved to a file named "--epochs".
    let e = parse(&["--save", "--epochs", "3"]).err().unwrap();
    assert!(e.contains("--save needs a value"), "{e}");
}

#[test]
fn stray_arguments_are_errors() {
    let e = parse(&["--epochs", "3", "extra"]).err().unwrap();
    assert!(e.contains("extra"), "{e}");
}

#[test]
fn common_and_extra_options_parse() {
    let a = parse(&[
        "--epochs",
        "3",
        "--lr",
        "0.01",
        "--batchnorm",
        "--hidden=64",
        "--load",
        "m.bin",
    ])
    .unwrap();
    assert_eq!(a.get::<usize>("epochs"), Some(3));
    assert_eq!(a.lr(1.0), 0.01);
    assert!(a.flag("batchnorm") && !a.flag("no-finite-check"));
    assert_eq!(a.get::<usize>("hidden"), Some(64));
    assert_eq!(a.get::<String>("load").as_deref(), Some("m.bin"));
    assert_eq!(a.get_or("batch", 64usize), 64);
    // Every training example takes the same common options.
    for name in ["epochs", "batch", "lr", "seed", "save", "load", "data"] {
        assert!(cli::COMMON.iter().any(|o| o.name == name), "{name}");
    }
}
