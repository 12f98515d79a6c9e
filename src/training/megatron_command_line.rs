//! Megatron's command-line conventions for a tool's arguments, before clap parses them:
//! flags that steer only Megatron's own machinery are dropped (and named in one warning),
//! flags that would change the math are refused with their reason, and a flag nobody has
//! gets the nearest real one suggested. (A repeated flag's last value winning, as argparse
//! does, is clap's `args_override_self`, which every tool sets.)

use std::ffi::OsString;

use super::megatron_flags::{Handling, MegatronFlag, Takes, MEGATRON_FLAGS};

/// A command line with the flags ferrotron does not implement taken out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScreenedArgs {
    /// What clap parses.
    pub argv: Vec<OsString>,
    /// The Megatron flags dropped because they do not change the math, in order, once each.
    pub ignored: Vec<String>,
}

impl ScreenedArgs {
    /// The one warning line naming the ignored flags (none when there are none).
    pub fn warning(&self) -> Option<String> {
        (!self.ignored.is_empty()).then(|| {
            format!(
                "warning: accepted and ignored (they steer only Megatron's own kernels, communication or bookkeeping; the math is unchanged): {}",
                self.ignored.join(" ")
            )
        })
    }
}

/// Screens `argv` (program name first) for `command`, whose own flags pass untouched.
pub fn screen_megatron_flags(
    command: &clap::Command,
    argv: impl IntoIterator<Item = OsString>,
) -> Result<ScreenedArgs, String> {
    let known: Vec<String> = command
        .get_arguments()
        .flat_map(|a| {
            a.get_long()
                .into_iter()
                .chain(a.get_all_aliases().unwrap_or_default())
                .map(|name| format!("--{name}"))
        })
        .collect();
    let mut tokens = argv.into_iter().peekable();
    let mut screened = ScreenedArgs {
        argv: tokens.next().into_iter().collect(),
        ignored: Vec::new(),
    };
    while let Some(token) = tokens.next() {
        let text = token.to_string_lossy().into_owned();
        let (name, inline) = match text.split_once('=') {
            Some((name, value)) if name.starts_with("--") => (name.to_owned(), Some(value)),
            _ => (text.clone(), None),
        };
        if !name.starts_with("--") || name == "--" || known.contains(&name) {
            screened.argv.push(token);
            continue;
        }
        let Some(flag) = MEGATRON_FLAGS.iter().find(|f| f.name == name) else {
            return Err(unknown_flag(&name, &known));
        };
        let mut values: Vec<String> = inline.map(str::to_owned).into_iter().collect();
        if inline.is_none() && flag.takes != Takes::Nothing {
            while let Some(next) = tokens.peek() {
                let next = next.to_string_lossy();
                if next.starts_with("--") && next.len() > 2 {
                    break;
                }
                values.push(next.into_owned());
                tokens.next();
                if flag.takes == Takes::One {
                    break;
                }
            }
        }
        handle(flag, &values, &mut screened.ignored)?;
    }
    Ok(screened)
}

/// Ignores `flag` or refuses it (unless its value is the harmless one).
fn handle(flag: &MegatronFlag, values: &[String], ignored: &mut Vec<String>) -> Result<(), String> {
    match flag.handling {
        Handling::Ignored => {
            if !ignored.iter().any(|n| n == flag.name) {
                ignored.push(flag.name.to_owned());
            }
            Ok(())
        }
        Handling::Refused { harmless, .. }
            if harmless.is_some_and(|h| values.len() == 1 && same_value(&values[0], h)) =>
        {
            Ok(())
        }
        Handling::Refused { reason, .. } => {
            let given = if values.is_empty() {
                flag.name.to_owned()
            } else {
                format!("{} {}", flag.name, values.join(" "))
            };
            Err(format!("{given}: {reason}"))
        }
    }
}

/// `1` and `1.0` are the same value to argparse's `type=int`/`float`.
fn same_value(given: &str, harmless: &str) -> bool {
    given == harmless
        || matches!((given.parse::<f64>(), harmless.parse::<f64>()), (Ok(a), Ok(b)) if a == b)
}

/// The error for a flag neither this tool nor Megatron has, with the nearest real one.
fn unknown_flag(name: &str, known: &[String]) -> String {
    let nearest = known
        .iter()
        .map(String::as_str)
        .chain(MEGATRON_FLAGS.iter().map(|f| f.name))
        .map(|candidate| (strsim::levenshtein(name, candidate), candidate))
        .min();
    match nearest {
        Some((distance, candidate)) if distance <= name.len() / 2 => {
            format!("unrecognized argument {name} (neither Megatron-LM nor ferrotron has it); did you mean {candidate}?")
        }
        _ => format!("unrecognized argument {name} (neither Megatron-LM nor ferrotron has it)"),
    }
}
