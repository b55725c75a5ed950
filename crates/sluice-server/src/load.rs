//! Reading a config file: YAML into the library's model, then compiled rules. Every
//! error names the file, a line and column, and what to write instead.

use crate::config::Config;
use sluice::config::{DomainConfig, LimiterConfig};
use sluice::rules::Rules;
use std::fmt;
use std::path::Path;

/// The config `sluice serve` runs without `--config`.
pub const DEFAULT_CONFIG: &str = include_str!("default.yaml");

/// A config that cannot be used.
#[derive(Debug)]
pub struct ConfigError {
    pub file: String,
    /// 1-based line and column, when known.
    pub at: Option<(usize, usize)>,
    pub message: String,
}

impl std::error::Error for ConfigError {}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.at {
            Some((line, col)) => write!(f, "{}:{line}:{col}: {}", self.file, self.message),
            None => write!(f, "{}: {}", self.file, self.message),
        }
    }
}

/// A config and the rules compiled from it.
pub struct Loaded {
    pub config: Config,
    pub rules: Rules,
}

/// `sluice config check FILE`: loads the file, or says where it is wrong.
pub fn check(file: &Path) -> Result<(), ConfigError> {
    load_file(file)?;
    println!("{}: ok", file.display());
    Ok(())
}

/// Reads and compiles a config file, and the domain files of its `domains_from`.
pub fn load_file(path: &Path) -> Result<Loaded, ConfigError> {
    let file = path.display().to_string();
    let text = read(path)?;
    let mut config = parse_config(&text, &file)?;
    if let Some(dir) = config.domains_from.clone() {
        let dir = path.parent().unwrap_or(Path::new(".")).join(dir);
        for path in domain_files(&dir)? {
            config.domains.push(domain_file(&read(&path)?, &path.display().to_string())?);
        }
    }
    compile(config, &text, &file)
}

/// One envoyproxy/ratelimit domain file's text (from `file`), parsed and compiled alone,
/// so a mistake is reported in its own file.
pub fn domain_file(text: &str, file: &str) -> Result<DomainConfig, ConfigError> {
    let domain: DomainConfig = parse(text, file)?;
    Rules::compile(&LimiterConfig::default(), std::slice::from_ref(&domain)).map_err(|e| ConfigError {
        file: file.to_string(),
        at: locate(text, &e.anchors),
        message: e.to_string(),
    })?;
    Ok(domain)
}

/// Compiles a parsed config (whose text is `text`, from `file`). A config without any
/// domain is refused: it would answer every request "unknown domain", and it is what an
/// editor that truncates a file before writing it leaves for a moment.
fn compile(config: Config, text: &str, file: &str) -> Result<Loaded, ConfigError> {
    if config.domains.is_empty() {
        let message = match config.domains_from {
            Some(_) => "no domain: the domains_from directory holds no *.yaml or *.yml file, and `domains:` is empty",
            None => "no domain: add a `domains:` list (or `domains_from:` a directory of domain files)",
        };
        return Err(ConfigError { file: file.to_string(), at: None, message: message.into() });
    }
    let rules = config.rules().map_err(|e| ConfigError {
        file: file.to_string(),
        at: locate(text, &e.anchors),
        message: e.to_string(),
    })?;
    Ok(Loaded { config, rules })
}

/// The `*.yaml` and `*.yml` files of a `domains_from` directory, by name.
fn domain_files(dir: &Path) -> Result<Vec<std::path::PathBuf>, ConfigError> {
    let entries = std::fs::read_dir(dir).map_err(|e| ConfigError {
        file: dir.display().to_string(),
        at: None,
        message: format!("cannot read the domains_from directory: {e}"),
    })?;
    let mut files: Vec<_> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    files.sort();
    Ok(files)
}

/// Everything a config is made of, for the reload watcher to compare: the file, and the
/// names and bytes of its domain files.
pub fn fingerprint(path: &Path) -> Option<Vec<u8>> {
    let mut out = std::fs::read(path).ok()?;
    if let Ok(config) = serde_norway::from_slice::<Config>(&out)
        && let Some(dir) = config.domains_from
    {
        let dir = path.parent().unwrap_or(Path::new(".")).join(dir);
        for f in domain_files(&dir).ok()? {
            out.extend(f.display().to_string().bytes());
            out.extend(std::fs::read(&f).ok()?);
        }
    }
    Some(out)
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|e| ConfigError {
        file: path.display().to_string(),
        at: None,
        message: format!("cannot read the config file: {e}"),
    })
}

/// Parses and compiles config text; `file` names it in errors.
pub fn load_str(text: &str, file: &str) -> Result<Loaded, ConfigError> {
    compile(parse_config(text, file)?, text, file)
}

/// A config file's text; one with nothing but blank lines and comments is an empty
/// config (YAML itself calls it no document at all).
fn parse_config(text: &str, file: &str) -> Result<Config, ConfigError> {
    let blank = text.lines().all(|l| l.trim().is_empty() || l.trim_start().starts_with('#'));
    if blank { Ok(Config::default()) } else { parse(text, file) }
}

/// YAML into `T`, with errors at file:line:col.
fn parse<T: serde::de::DeserializeOwned>(text: &str, file: &str) -> Result<T, ConfigError> {
    let err = |at, message| ConfigError { file: file.to_string(), at, message };
    serde_norway::from_str(text).map_err(|e| {
        // the library writes "at line L column C" into its message; the position goes in
        // front instead
        let msg = without_position(e.to_string());
        // A value that fails its own check (a unit, a duration, a name) is reported at
        // the start of the mapping holding it; our messages quote the value in
        // backticks, so look for it from there.
        let at = e.location().map(|l| {
            let quoted = msg.split('`').nth(1).filter(|q| !q.is_empty());
            quoted
                .and_then(|q| find_word(text, l.index(), q))
                .map_or(within(text, l.line(), l.column()), |i| position(text, i))
        });
        err(at, msg)
    })
}

/// `msg` without the " at line L column C" the YAML library puts in it (at its end, or
/// before a ", while ..." clause).
fn without_position(mut msg: String) -> String {
    if let Some(i) = msg.find(" at line ") {
        let rest = &msg[i + " at line ".len()..];
        let digits = |s: &str| s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let after_line = digits(rest);
        if let Some(col) = rest[after_line..].strip_prefix(" column ") {
            let end = i + " at line ".len() + after_line + " column ".len() + digits(col);
            msg.replace_range(i..end, "");
        }
    }
    msg
}

/// A line and column the YAML library gave, kept inside the text: at the end of a text
/// without a final newline it names the line after the last one.
fn within(text: &str, line: usize, column: usize) -> (usize, usize) {
    let lines = text.replace("\r\n", "\n").split(['\n', '\r']).count();
    match line > lines {
        true => position(text, text.len()),
        false => (line, column),
    }
}

/// Finds each anchor in turn, each after the one before, and returns the position of
/// the last one found: the line of the rule an error is about.
fn locate(text: &str, anchors: &[String]) -> Option<(usize, usize)> {
    let mut from = 0;
    let mut found = None;
    for a in anchors {
        if let Some(i) = find_word(text, from, a) {
            found = Some(i);
            from = i + a.len();
        }
    }
    found.map(|at| position(text, at))
}

/// The first occurrence of `word` at or after byte `from` that is not part of a longer
/// word.
fn find_word(text: &str, from: usize, word: &str) -> Option<usize> {
    let is_word = |c: char| c.is_alphanumeric() || c == '_' || c == '-';
    let mut start = from.min(text.len());
    while let Some(i) = text.get(start..)?.find(word) {
        let at = start + i;
        let before = text[..at].chars().next_back();
        let after = text[at + word.len()..].chars().next();
        if !before.is_some_and(is_word) && !after.is_some_and(is_word) {
            return Some(at);
        }
        start = at + word.len().max(1);
    }
    None
}

/// 1-based line and column of byte `at`.
fn position(text: &str, at: usize) -> (usize, usize) {
    let line = text[..at].matches('\n').count() + 1;
    let col = text[..at].chars().rev().take_while(|&c| c != '\n').count() + 1;
    (line, col)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_config_loads() {
        let l = load_str(DEFAULT_CONFIG, "default.yaml").unwrap();
        assert!(l.rules.domain_names().contains(&"demo"));
    }

    #[test]
    fn a_config_without_domains_is_refused() {
        for text in ["", "# nothing yet\n", "server:\n  http: 127.0.0.1:8080\n", "domains: []\n"] {
            let e = load_str(text, "c.yaml").err().unwrap_or_else(|| panic!("{text:?} was accepted"));
            assert!(e.to_string().starts_with("c.yaml: no domain"), "{text:?}: {e}");
        }
    }

    #[test]
    fn rule_errors_point_at_the_rule() {
        let text = "domains:\n  - domain: d\n    descriptors:\n      - key: a\n        policies:\n          - name: p\n            fixed_window: {limit: 0, window: 1s}\n";
        let e = load_str(text, "c.yaml").err().unwrap();
        assert_eq!(e.at, Some((6, 19)), "{e}");
        assert!(e.to_string().starts_with("c.yaml:6:19: "), "{e}");
        assert!(e.message.contains("at least 1"), "{e}");
    }

    #[test]
    fn parse_errors_point_at_the_value() {
        let text = "domains:\n  - domain: d\n    descriptors:\n      - key: a\n        rate_limit:\n          requests_per_unit: 5\n          unit: fortnight\n";
        let e = load_str(text, "c.yaml").err().unwrap();
        assert_eq!(e.at.map(|a| a.0), Some(7), "{e}");
        assert!(e.message.contains("unknown unit `fortnight`"), "{e}");
    }

    /// A file cut short mid-key (found by the fuzzer): the position is inside the file
    /// (the YAML library names line 4 of 3), and not repeated in the message.
    #[test]
    fn a_truncated_file_is_placed_on_its_last_line() {
        let e = load_str("server:\n  http: 127.0.0.1:0\nd", "c.yaml").err().unwrap();
        assert_eq!(e.at, Some((3, 2)), "{e}");
        assert!(!e.message.contains("line 4"), "{e}");
    }
}
