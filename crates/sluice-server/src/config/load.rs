//! Reading a config file: YAML into the library's model, then compiled rules. Every
//! error names the file, a line and column, and what to write instead.

use crate::config::Config;
use sluice::config::{DescriptorConfig, DomainConfig, LimiterConfig};
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
        let message = excerpt(&self.message);
        match self.at {
            Some((line, col)) => write!(f, "{}:{line}:{col}: {message}", self.file),
            None => write!(f, "{}: {message}", self.file),
        }
    }
}

/// The longest message an error shows whole: the YAML library quotes the value it could
/// not read, and a garbage file of 50 MB on one line was echoed whole in the log.
const MAX_MESSAGE: usize = 1_000;

/// `message`, its middle cut past [`MAX_MESSAGE`] bytes (saying how much).
pub fn excerpt(message: &str) -> std::borrow::Cow<'_, str> {
    if message.len() <= MAX_MESSAGE {
        return message.into();
    }
    let boundary = |mut i: usize, step: isize| {
        while !message.is_char_boundary(i) {
            i = i.saturating_add_signed(step);
        }
        i
    };
    let (head, tail) = (boundary(MAX_MESSAGE * 3 / 4, -1), boundary(message.len() - MAX_MESSAGE / 4, 1));
    format!("{} ... ({} bytes cut) ... {}", &message[..head], tail - head, &message[tail..]).into()
}

/// A config and the rules compiled from it.
pub struct Loaded {
    pub config: Config,
    pub rules: Rules,
    /// What was read past but is worth a word: files of `domains_from` skipped (a
    /// symlink that leads nowhere). `serve` logs them, `config check` prints them.
    pub warnings: Vec<String>,
}

/// `sluice config check FILE`: loads the file and runs every check `serve` runs that
/// needs no network, or says where it is wrong. What only the store can say (that it
/// answers, that a Redis is new enough) is checked by `serve`, and shown by `/readyz`.
/// With `online`, the caller contacts the stores next, and the line says nothing of them.
pub fn check(file: &Path, online: bool) -> Result<(), ConfigError> {
    let loaded = load_file(file)?;
    for warning in &loaded.warnings {
        eprintln!("warning: {warning}");
    }
    let store = match loaded.config.store {
        _ if online => String::new(),
        crate::config::StoreConfig::Memory { .. } => String::new(),
        _ => " (the store is not contacted: that it answers, and runs Redis 7.0 or newer, `sluice serve` checks at start and `/readyz` shows; `--online` checks them now)".into(),
    };
    println!("{}: ok{store}", file.display());
    Ok(())
}

/// Where a config comes from: a file, or text made in memory (the config
/// `--ratelimit-env` reads from the environment: written nowhere, as a container's root
/// file system is often read-only).
#[derive(Debug, Clone)]
pub enum Source {
    File(std::path::PathBuf),
    Text { name: String, text: String },
}

impl Source {
    /// How errors name it.
    pub fn name(&self) -> String {
        match self {
            Source::File(path) => path.display().to_string(),
            Source::Text { name, .. } => name.clone(),
        }
    }

    /// The file, if it is one.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Source::File(path) => Some(path),
            Source::Text { .. } => None,
        }
    }

    /// Its text now.
    pub fn read(&self) -> Result<String, ConfigError> {
        match self {
            Source::File(path) => read(path),
            Source::Text { text, .. } => Ok(text.clone()),
        }
    }

    /// What a relative `domains_from` is relative to: the file's directory.
    pub fn dir(&self) -> &Path {
        self.path().and_then(Path::parent).unwrap_or(Path::new("."))
    }
}

/// Reads and compiles a config file, and the domain files of its `domains_from`.
pub fn load_file(path: &Path) -> Result<Loaded, ConfigError> {
    load(&Source::File(path.to_path_buf()))
}

/// Reads and compiles a config, and the domain files of its `domains_from`.
pub fn load(source: &Source) -> Result<Loaded, ConfigError> {
    let file = source.name();
    let text = source.read()?;
    let mut config = parse_config(&text, &file)?;
    let mut warnings = Vec::new();
    if let Some(dir) = config.domains_from.clone() {
        let dir = source.dir().join(dir);
        let mut places = Places::default();
        for d in &config.domains {
            places.record(d, &text, &file);
        }
        let (files, skipped) = domain_files(&dir)?;
        warnings = skipped;
        for path in files {
            let name = path.display().to_string();
            let text = read(&path)?;
            let domain = domain_file(&text, &name)?;
            places.add(&mut config.domains, domain, &text, &name, config.envoy.merge_domains)?;
        }
    }
    let mut loaded = compile(config, &text, &file)?;
    loaded.warnings.splice(0..0, warnings);
    Ok(loaded)
}

/// The rules of `config` with `domains` in place of its own (pushed by xDS, each named
/// by its resource), compiled and checked against its store as a file's are: the domains
/// as one set, so a domain in two resources is refused unless `envoy.merge_domains`.
pub fn with_domains(
    config: &Config,
    domains: Vec<(String, DomainConfig)>,
) -> Result<(Vec<DomainConfig>, Rules), ConfigError> {
    let mut places = Places { pushed: true, ..Places::default() };
    let mut all = Vec::new();
    for (name, domain) in domains {
        // each alone first, so an error names the resource it is in
        Rules::compile(&config.limiter, std::slice::from_ref(&domain)).map_err(|e| ConfigError {
            file: name.clone(),
            at: None,
            message: e.to_string(),
        })?;
        places.add(&mut all, domain, "", &name, config.envoy.merge_domains)?;
    }
    let with = Config { domains: all, ..config.clone() };
    let err = |e: String| ConfigError { file: "the pushed rules".into(), at: None, message: e };
    let rules = with.rules().map_err(|e| err(e.to_string()))?;
    crate::config::checks::store(&with.store, &rules).map_err(|e| err(e.message))?;
    Ok((with.domains, rules))
}

/// Where each domain read so far, and each of its top-level rules, was defined
/// (`file:line:col`), so a second definition is refused naming both places.
#[derive(Default)]
struct Places {
    domains: std::collections::HashMap<String, String>,
    rules: std::collections::HashMap<(String, String, Option<String>), String>,
    /// The domains come over xDS, each from a resource (not from files).
    pushed: bool,
}

impl Places {
    /// Notes where `d` and its top-level rules are, in `text` (of `file`).
    fn record(&mut self, d: &DomainConfig, text: &str, file: &str) {
        let name = &d.domain.0;
        self.domains.entry(name.clone()).or_insert_with(|| place(file, locate(text, std::slice::from_ref(name))));
        for c in &d.descriptors {
            let at = place(file, locate(text, &rule_anchors(name, c)));
            self.rules.insert((name.clone(), c.key.clone(), c.value.clone()), at);
        }
    }

    /// Adds domain file `file`'s domain: a new one, or (with `merge`) more rules of one
    /// read before, none of which may be defined already.
    fn add(
        &mut self,
        domains: &mut Vec<DomainConfig>,
        domain: DomainConfig,
        text: &str,
        file: &str,
        merge: bool,
    ) -> Result<(), ConfigError> {
        let name = domain.domain.0.clone();
        let err = |anchors: &[String], message: String| ConfigError {
            file: file.to_string(),
            at: locate(text, anchors),
            message,
        };
        let Some(first) = domains.iter_mut().find(|d| d.domain.0 == name) else {
            self.record(&domain, text, file);
            domains.push(domain);
            return Ok(());
        };
        if !merge {
            let (unit, units) = if self.pushed { ("resource", "resources") } else { ("file", "files") };
            let message = format!(
                "domain '{name}' is also defined at {}; keep one domain to a {unit}, or set \
                 `envoy.merge_domains: true` to read the {units} as one domain",
                self.domains[&name]
            );
            return Err(err(std::slice::from_ref(&name), message));
        }
        for c in &domain.descriptors {
            if let Some(there) = self.rules.get(&(name.clone(), c.key.clone(), c.value.clone())) {
                let rule = c.value.as_ref().map_or(format!("`key: {}`", c.key), |v| format!("`{}: {v}`", c.key));
                let message = format!(
                    "{rule} of domain '{name}' is also defined at {there}; merged files must not both define a rule"
                );
                return Err(err(&rule_anchors(&name, c), message));
            }
        }
        if (first.shadow_mode, &first.client_key) != (domain.shadow_mode, &domain.client_key) {
            let message = format!(
                "domain '{name}' is also defined at {} with another `shadow_mode` or `client_key`; \
                 merged files must agree on them",
                self.domains[&name]
            );
            return Err(err(std::slice::from_ref(&name), message));
        }
        self.record(&domain, text, file);
        first.descriptors.extend(domain.descriptors);
        Ok(())
    }
}

/// The texts on the way to a top-level rule: its domain, key and value.
fn rule_anchors(domain: &str, c: &DescriptorConfig) -> Vec<String> {
    [domain, &c.key].into_iter().chain(c.value.as_deref()).map(str::to_string).collect()
}

/// `file:line:col`, or `file` when the position is not known.
fn place(file: &str, at: Option<(usize, usize)>) -> String {
    match at {
        Some((line, col)) => format!("{file}:{line}:{col}"),
        None => file.to_string(),
    }
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
fn compile(mut config: Config, text: &str, file: &str) -> Result<Loaded, ConfigError> {
    if config.xds.is_some() {
        // rules in envoyproxy/ratelimit's form, from its control planes: counted as it does
        config.limiter.count_refused_hits.get_or_insert(true);
        config.limiter.aligned_windows.get_or_insert(true);
    }
    if config.xds.is_some() && (!config.domains.is_empty() || config.domains_from.is_some()) {
        let message = "`xds` and `domains`/`domains_from` are both set: with `xds` the rules are the management \
                       server's alone, and a config never mixes them; remove one";
        return Err(ConfigError { file: file.to_string(), at: locate(text, &["xds".into()]), message: message.into() });
    }
    if config.domains.is_empty() && config.xds.is_none() {
        let message = match config.domains_from {
            Some(_) => "no domain: the domains_from directory holds no *.yaml or *.yml file, and `domains:` is empty",
            None => "no domain: add a `domains:` list (or `domains_from:` a directory of domain files)",
        };
        return Err(ConfigError { file: file.to_string(), at: None, message: message.into() });
    }
    let exposed = crate::config::secrets::read(&mut config).map_err(|e| ConfigError {
        file: file.to_string(),
        at: locate(text, &e.anchors),
        message: e.message,
    })?;
    let mut rules = config.rules().map_err(|e| ConfigError {
        file: file.to_string(),
        at: locate(text, &e.anchors),
        message: e.to_string(),
    })?;
    if let Some(xds) = &config.xds {
        // the rules are the control plane's: none until its first push
        rules = rules.pending(xds.waiting());
    }
    let checked = crate::config::checks::server(&config.server)
        .and_then(|()| config.xds.as_ref().map_or(Ok(()), crate::config::checks::xds))
        .and_then(|()| crate::config::checks::telemetry(&config.telemetry))
        .and_then(|()| crate::config::checks::store(&config.store, &rules))
        .and_then(|()| crate::config::checks::reservations(&config.limiter, &config.store))
        .and_then(|()| crate::config::checks::regions(&config, &rules));
    checked.map_err(|e| ConfigError { file: file.to_string(), at: locate(text, &e.anchors), message: e.message })?;
    let mut warnings = exposed;
    warnings.extend(crate::config::checks::short_global_windows(&rules));
    Ok(Loaded { config, rules, warnings })
}

/// The `*.yaml` and `*.yml` files of a `domains_from` directory, by name; and a line for
/// each such name that was skipped because it is no file to read (a symlink that leads
/// nowhere, or to itself; a directory).
pub fn domain_files(dir: &Path) -> Result<(Vec<std::path::PathBuf>, Vec<String>), ConfigError> {
    let entries = std::fs::read_dir(dir).map_err(|e| ConfigError {
        file: dir.display().to_string(),
        at: None,
        message: format!("cannot read the domains_from directory: {e}"),
    })?;
    let (mut files, mut skipped) = (Vec::new(), Vec::new());
    let named = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        // a hidden file is an editor's or a deployment tool's, not a domain
        .filter(|p| !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')));
    for path in named {
        match std::fs::metadata(&path) {
            Ok(m) if m.is_file() => files.push(path),
            Ok(_) => skipped.push(format!("{}: not a file; skipped", path.display())),
            Err(e) => skipped.push(format!("{}: a symlink that leads to no file ({e}); skipped", path.display())),
        }
    }
    files.sort();
    skipped.sort();
    Ok((files, skipped))
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
    if blank {
        return Ok(Config::default());
    }
    // an error the YAML library could not place (inside a section of several kinds, such
    // as `store`, it names the file's start) is placed at its section's key, and named
    parse(text, file).map_err(|e| match e.at {
        Some(at) if at != (1, 1) => e,
        _ => section_error(text, file).unwrap_or(e),
    })
}

/// `msg` with what to write instead, where the library's words do not say.
fn with_fix(mut msg: String) -> String {
    if msg.contains("socket address") {
        msg += "; write IP:PORT, e.g. 127.0.0.1:9000, or [::]:9000 for every address (a host name such as localhost is not taken)";
    }
    msg
}

/// The error of the section that does not parse, named (`store: missing field `url``)
/// and placed at its key: an error inside a section of several kinds (`store`,
/// `telemetry`) is placed by the YAML library at the start of the file, without a path.
fn section_error(text: &str, file: &str) -> Option<ConfigError> {
    let doc: serde_norway::Value = serde_norway::from_str(text).ok()?;
    for (key, value) in doc.as_mapping()? {
        let key = key.as_str()?;
        let err = |e: serde_norway::Error| with_fix(without_position(e.to_string()));
        let message = match key {
            "server" => serde_norway::from_value::<crate::config::ServerConfig>(value.clone()).err().map(err),
            "store" => serde_norway::from_value::<crate::config::StoreConfig>(value.clone()).err().map(err),
            "limiter" => serde_norway::from_value::<LimiterConfig>(value.clone()).err().map(err),
            "telemetry" => serde_norway::from_value::<crate::config::TelemetryConfig>(value.clone()).err().map(err),
            "log" => serde_norway::from_value::<crate::logs::LogConfig>(value.clone()).err().map(err),
            _ => None,
        };
        if let Some(message) = message {
            let at = locate(text, &[key.to_string()]);
            let fix = missing_field_fix(&message).map_or(String::new(), |f| format!("; {f}"));
            return Some(ConfigError { file: file.to_string(), at, message: format!("{key}: {message}{fix}") });
        }
    }
    None
}

/// YAML into `T`, with errors at file:line:col.
fn parse<T: serde::de::DeserializeOwned>(text: &str, file: &str) -> Result<T, ConfigError> {
    let err = |at, message| ConfigError { file: file.to_string(), at, message };
    serde_norway::from_str(text).map_err(|e| {
        // the library writes "at line L column C" into its message; the position goes in
        // front instead
        let msg = with_fix(without_position(e.to_string()));
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

/// What to write for a field a store kind requires, when `message` says it is missing.
fn missing_field_fix(message: &str) -> Option<&'static str> {
    let field = message.strip_prefix("missing field `")?.split('`').next()?;
    Some(match field {
        "url" => "add `url: redis://HOST:PORT`",
        "nodes" => "add `nodes: [redis://HOST:PORT, ...]` (any nodes of the cluster)",
        "servers" => "add `servers: [HOST:PORT, ...]`",
        "sentinels" => "add `sentinels: [HOST:PORT, ...]`",
        "master_name" => "add `master_name:` the name the Sentinels monitor",
        "shards" => "add `shards: [{primary: redis://HOST:PORT}, ...]`",
        "from" | "to" => {
            "a migrating store needs `from:` and `to:`, each a store (`{kind: memcached, servers: [...]}`)"
        }
        "percent" => "add `percent: 0` (the share of clients on `to`)",
        "kind" => "add `kind:` memory, redis, redis_sentinel, redis_cluster, redis_sharded, memcached or migrating",
        _ => return None,
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
mod tests;
