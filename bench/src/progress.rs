//! A progress bar for long evaluations: drawn on a terminal; elsewhere (a log file) only the
//! lines printed through it appear.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// A bar, or nothing to draw when stderr is not a terminal.
pub struct Bar(Option<ProgressBar>);

/// A bar of `len` steps labelled `tag`.
pub fn bar(len: u64, tag: &str) -> Bar {
    if !std::io::stderr().is_terminal() {
        return Bar(None);
    }
    let b = ProgressBar::new(len);
    if let Ok(style) =
        ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed_precise} eta {eta}")
    {
        b.set_style(style.progress_chars("=> "));
    }
    b.set_prefix(tag.to_string());
    Bar(Some(b))
}

impl Bar {
    pub fn set_position(&self, pos: u64) {
        if let Some(b) = &self.0 {
            b.set_position(pos);
        }
    }

    pub fn inc(&self, n: u64) {
        if let Some(b) = &self.0 {
            b.inc(n);
        }
    }

    /// A line on stderr, above the bar if there is one.
    pub fn println(&self, line: String) {
        match &self.0 {
            Some(b) => b.println(line),
            None => eprintln!("{line}"),
        }
    }

    pub fn finish_and_clear(&self) {
        if let Some(b) = &self.0 {
            b.finish_and_clear();
        }
    }
}
