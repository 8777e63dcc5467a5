//! The `--name value` option parsing the training examples share (they
//! include this file by path).

/// The value after `name` in `args`, parsed, or `default` when absent; a
/// missing or unparsable value ends the process with a message.
pub fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| {
                eprintln!("{name} needs a value");
                std::process::exit(2)
            }),
        None => default,
    }
}
