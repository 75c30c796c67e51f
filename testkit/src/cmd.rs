//! Running external programs with readable progress and failure messages.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use anyhow::{bail, Context, Result};

/// A command line as the user would type it, for progress lines and error messages.
pub fn display(cmd: &Command) -> String {
    let program = Path::new(cmd.get_program());
    // `$CARGO` is a long toolchain path; show it as the user would type it.
    let program = match program.file_name() {
        Some(name) if name == "cargo" => "cargo".to_string(),
        _ => program.to_string_lossy().into_owned(),
    };
    let mut parts = vec![program];
    parts.extend(cmd.get_args().map(quote));
    parts.join(" ")
}

fn quote(arg: &OsStr) -> String {
    let s = arg.to_string_lossy();
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@+%".contains(c));
    if plain {
        s.into_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Runs `cmd` with inherited stdio; fails with the command line and exit status if it fails.
pub fn run(cmd: &mut Command) -> Result<()> {
    let line = display(cmd);
    let status = cmd
        .status()
        .with_context(|| format!("could not start `{line}`"))?;
    if !status.success() {
        bail!("`{line}` failed ({status})");
    }
    Ok(())
}

/// Runs `cmd` capturing its output; fails with the command line, status and stderr if it fails.
pub fn output(cmd: &mut Command) -> Result<Output> {
    let line = display(cmd);
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("could not start `{line}`"))?;
    if !out.status.success() {
        bail!(
            "`{line}` failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out)
}

/// Captured stdout of a successful command, trimmed.
pub fn stdout_of(cmd: &mut Command) -> Result<String> {
    let out = output(cmd)?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Fails with an install hint if `program` cannot be started (checked with `program --version`).
pub fn require_tool(program: &str, purpose: &str, install_hint: &str) -> Result<String> {
    match Command::new(program)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
    {
        Ok(out) if out.status.success() => {
            let text = if out.stdout.is_empty() {
                out.stderr
            } else {
                out.stdout
            };
            Ok(String::from_utf8_lossy(&text).trim().to_string())
        }
        Ok(out) => bail!(
            "`{program} --version` failed ({}); {program} is needed {purpose}. {install_hint}",
            out.status
        ),
        Err(_) => {
            bail!("`{program}` was not found on PATH; it is needed {purpose}. {install_hint}")
        }
    }
}
