//! envoyproxy/ratelimit's own config test suite (`test/config/config_test.go` at commit
//! f2fb157), ported: each expectation it states that can be seen from outside the
//! process is checked against a running Sluice, and the test prints how many hold.
//!
//! Their fixtures are in `tests/envoy-ratelimit-suite/`, unchanged. Each Go test
//! function is one [`Case`]: its files (their fixture, or the YAML of the config their
//! Go code builds inline, written out as the same rules) in a directory that one
//! `sluice serve` loads with `domains_from`, then its calls and checks in their order:
//!
//! - `GetLimit(domain, descriptor)`: one `ShouldRateLimit` call with that descriptor; its
//!   `statuses[0].current_limit` is their `rl.Limit` (`RequestsPerUnit`, `Unit`, `Name`),
//!   none is their `nil` (and their `Unlimited`, with code OK);
//! - a stat name (`test-domain.key1_value1.subkey1.total_hits`): the debug listener's
//!   `/stats` line `ratelimit.service.rate_limit.NAME: K`, K the calls made to it. Their
//!   tests increment every counter of a limit by hand, where a real decision increments
//!   `total_hits` and one outcome: so `total_hits` is checked to the count, and the
//!   `over_limit`, `near_limit`, `within_limit` and `shadow_mode` they increment by hand
//!   are checked to be there under that name (a counter they expect 0, to be 0; the
//!   shadow counter, to be 1 after one call over the shadow limit);
//! - `rl.ShadowMode`: the rule's `/rlconfig` line (`shadow_mode: true`);
//! - `rl.Metadata`: the response's `dynamic_metadata` with `envoy.response_dynamic_metadata`;
//! - a file their loader refuses (a panic, with an error text): `sluice config check` on
//!   a config whose `domains_from` directory holds only that file exits non-zero (one
//!   expectation), and its message says the same in substance (a second).
//!
//! Not portable, so not counted (each is Go API with no effect outside their process):
//! `rlConfig.Dump()` (a Go string; `/rlconfig` prints the rules, and is checked where
//! they check shadow mode), `IsEmptyDomains()` (a Go method), `rl.FullKey` (their cache
//! key's text, internal to their store; that values share a counter is checked through
//! the stats key they share), `rl.ShareThresholdKeyPattern` (a Go field: its effect is
//! the stats key, checked), `rl.DetailedMetric` (a Go field: its effect is the stat name,
//! checked). Where their inline configs reuse one domain name across sub-tests
//! (`TestDetailedMetric`, `TestWildcardStatsBehavior`), each sub-test's config gets its
//! own domain here (`nested1` ..., `test-domain-1` ...), so that one server holds them
//! all, and their expected names get that domain.

mod common;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{Entry, RateLimitOverride};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, RateLimit, rate_limit::Unit};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use sluice_testkit::TempDir;

/// The prefix of every rule stat in `/stats`, as their service scopes them.
const STAT: &str = "ratelimit.service.rate_limit.";

/// One thing their test does, in order: a call, or a check of what is seen.
enum Step {
    /// `GetLimit`: a `ShouldRateLimit` call, costing `hits`, with a descriptor `limit`.
    Ask {
        domain: &'static str,
        entries: Vec<(&'static str, &'static str)>,
        limit: Option<(u32, RateLimitUnit)>,
        hits: u32,
    },
    /// Calls of one hit until the first hit over the (shadow) limit of the stats key
    /// `key` is counted: their hand-made `ShadowMode.Inc()`, made by a real decision.
    OverShadow { entries: Vec<(&'static str, &'static str)>, key: String },
    /// A check stated at this line of config_test.go.
    Check(u32, Check),
}

/// What one expectation checks.
enum Check {
    Rpu(u32),
    Unit(Unit),
    /// `AssertProtoEqual(RateLimit{RequestsPerUnit, Unit}, rl.Limit)`: these, no name.
    Limit(u32, Unit),
    Name(&'static str),
    /// `assert.Nil(GetLimit(...))`: OK, no limit.
    NoLimit,
    /// `assert.NotNil(GetLimit(...))`: a limit.
    SomeLimit,
    /// `rl.Unlimited`: OK, no limit.
    Unlimited,
    /// `assert.Equal(rl1, rl2)`: the last two calls got the same limit.
    SameLimit,
    /// The `/stats` counter `NAME` (less their scope) is this.
    Stat(String, Count),
    /// The `/rlconfig` line of this stats key says this shadow mode.
    Rlconfig(String, bool),
    /// The response's `dynamic_metadata` `metadata`, at this path, is this string (or a
    /// struct, when `None`).
    Meta(Vec<&'static str>, Option<&'static str>),
}

/// What a stat should count.
enum Count {
    Exactly(u64),
    AtLeast(u64),
    /// There under this name: a counter they increment by hand.
    Named,
}

/// A Go test function: its files, and its calls and checks in their order.
struct Case {
    test: &'static str,
    files: Vec<(String, String)>,
    /// Top-level config beside `domains_from`.
    extra: &'static str,
    steps: Vec<Step>,
}

impl Case {
    fn new(test: &'static str, files: Vec<(String, String)>) -> Self {
        Case { test, files, extra: "", steps: Vec::new() }
    }

    fn ask(self, domain: &'static str, entries: &[(&'static str, &'static str)]) -> Self {
        self.call(domain, entries, None, 1)
    }

    fn call(
        mut self,
        domain: &'static str,
        entries: &[(&'static str, &'static str)],
        limit: Option<(u32, RateLimitUnit)>,
        hits: u32,
    ) -> Self {
        self.steps.push(Step::Ask { domain, entries: entries.to_vec(), limit, hits });
        self
    }

    fn over_shadow(mut self, entries: &[(&'static str, &'static str)], key: &str) -> Self {
        self.steps.push(Step::OverShadow { entries: entries.to_vec(), key: key.to_string() });
        self
    }

    fn check(mut self, line: u32, check: Check) -> Self {
        self.steps.push(Step::Check(line, check));
        self
    }

    fn nil(self, line: u32) -> Self {
        self.check(line, Check::NoLimit)
    }

    fn some(self, line: u32) -> Self {
        self.check(line, Check::SomeLimit)
    }

    fn rpu(self, line: u32, n: u32) -> Self {
        self.check(line, Check::Rpu(n))
    }

    fn unit(self, line: u32, unit: Unit) -> Self {
        self.check(line, Check::Unit(unit))
    }

    /// `assert.Nil(GetLimit(domain, entries))`.
    fn none_for(self, line: u32, domain: &'static str, entries: &[(&'static str, &'static str)]) -> Self {
        self.ask(domain, entries).nil(line)
    }

    /// Their `total_hits` of the stats key `key`, after the calls made to it.
    fn hits(self, line: u32, key: &str, n: u64) -> Self {
        self.check(line, Check::Stat(format!("{key}.total_hits"), Count::Exactly(n)))
    }

    fn count(self, line: u32, name: &str, count: Count) -> Self {
        self.check(line, Check::Stat(name.to_string(), count))
    }

    /// The three counters they increment by hand beside `total_hits`, at these lines.
    fn counters(self, [over, near, within]: [u32; 3], key: &str) -> Self {
        self.count(over, &format!("{key}.over_limit"), Count::Named)
            .count(near, &format!("{key}.near_limit"), Count::Named)
            .count(within, &format!("{key}.within_limit"), Count::Named)
    }

    fn rlconfig(self, line: u32, key: &str, shadow: bool) -> Self {
        self.check(line, Check::Rlconfig(key.to_string(), shadow))
    }

    fn meta(self, line: u32, path: &[&'static str], want: Option<&'static str>) -> Self {
        self.check(line, Check::Meta(path.to_vec(), want))
    }
}

/// Their fixture `name`, unchanged.
fn fixture(name: &str) -> (String, String) {
    let path = format!("{}/tests/envoy-ratelimit-suite/{name}", env!("CARGO_MANIFEST_DIR"));
    (name.to_string(), std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}")))
}

fn fixtures(names: &[&str]) -> Vec<(String, String)> {
    names.iter().map(|n| fixture(n)).collect()
}

/// The config their Go code builds inline, as YAML (one file).
fn inline(yaml: &str) -> Vec<(String, String)> {
    vec![("inline.yaml".to_string(), yaml.to_string())]
}

const TD: &str = "test-domain";

/// TestBasicConfig, basic_config.yaml: lines 30 to 225.
fn basic_config() -> Case {
    let k = "test-domain.key1_value1.subkey1";
    let kv = "test-domain.key1_value1.subkey1_subvalue1";
    let c = Case::new("TestBasicConfig", fixtures(&["basic_config.yaml"]))
        .count(36, "foo_domain.domain_not_found", Count::Exactly(0))
        .none_for(37, "foo_domain", &[])
        .count(38, "foo_domain.domain_not_found", Count::Exactly(1))
        .none_for(39, TD, &[])
        .count(40, "test-domain.domain_not_found", Count::Exactly(0))
        .none_for(47, TD, &[("key1", "something")])
        .none_for(54, TD, &[("key1", "value1")])
        .none_for(61, TD, &[("key2", "value2"), ("subkey", "subvalue")])
        .none_for(68, TD, &[("key5", "value5"), ("subkey5", "subvalue")])
        .ask(TD, &[("key1", "value1"), ("subkey1", "something")])
        .rpu(79, 5)
        .unit(80, Unit::Second)
        .hits(81, k, 1)
        .counters([82, 83, 84], k)
        .ask(TD, &[("key1", "value1"), ("subkey1", "subvalue1")])
        .rpu(95, 10)
        .unit(96, Unit::Second)
        .hits(98, kv, 1)
        .counters([100, 102, 104], kv)
        .ask(TD, &[("key2", "something")])
        .rpu(115, 20)
        .unit(116, Unit::Minute)
        .hits(117, "test-domain.key2", 1)
        .counters([118, 119, 120], "test-domain.key2")
        .ask(TD, &[("key2", "value2")])
        .rpu(131, 30)
        .unit(132, Unit::Minute)
        .hits(133, "test-domain.key2_value2", 1)
        .counters([134, 135, 136], "test-domain.key2_value2")
        .none_for(143, TD, &[("key2", "value3")])
        .ask(TD, &[("key3", "foo")])
        .rpu(154, 1)
        .check(155, Check::Name(""))
        .unit(156, Unit::Hour)
        .hits(157, "test-domain.key3", 1)
        .counters([158, 159, 160], "test-domain.key3");
    basic_config_rest(c)
}

/// TestBasicConfig, from line 162.
fn basic_config_rest(c: Case) -> Case {
    c.ask(TD, &[("key4", "foo")])
        .rpu(171, 1)
        .check(172, Check::Name("key4_rate_limit"))
        .unit(173, Unit::Day)
        .hits(174, "test-domain.key4", 1)
        .counters([175, 176, 177], "test-domain.key4")
        .ask(TD, &[("key6", "foo")])
        .check(186, Check::Unlimited)
        // their 1 is a hand increment: their service never counts an unlimited rule's
        // hits (ratelimit.go puts nil in its place), it only registers its stats
        .count(187, "test-domain.key6.total_hits", Count::Exactly(0))
        .count(188, "test-domain.key6.within_limit", Count::Named)
        .ask(TD, &[("key7", "unspecified_value")])
        .rpu(201, 70)
        .unit(202, Unit::Minute)
        .hits(203, "test-domain.key7_unspecified_value", 1)
        .counters([204, 205, 206], "test-domain.key7_unspecified_value")
        .ask(TD, &[("key7", "another_value")])
        .rpu(219, 70)
        .unit(220, Unit::Minute)
        .hits(221, "test-domain.key7_another_value", 1)
        .counters([222, 223, 224], "test-domain.key7_another_value")
}

/// TestDomainMerge (their `MergeDomainConfigs` true: `envoy.merge_domains`).
fn domain_merge() -> Case {
    let mut c = Case::new("TestDomainMerge", fixtures(&["merge_domain_key1.yaml", "merge_domain_key2.yaml"]));
    c.extra = "envoy: {merge_domains: true}\n";
    c.none_for(236, "foo_domain", &[])
        .none_for(237, TD, &[])
        .ask(TD, &[("key1", "value1")])
        .some(244)
        .rpu(245, 10)
        .ask(TD, &[("key2", "value2")])
        .some(252)
        .rpu(253, 20)
}

/// TestConfigLimitOverride: a descriptor's `limit` replaces the configured one.
fn limit_override() -> Case {
    let (key1, e1) = (("key1", "value1"), ("subkey1", "something"));
    let c = Case::new("TestConfigLimitOverride", fixtures(&["basic_config.yaml"]))
        .call("foo_domain", &[], Some((10, RateLimitUnit::Day)), 1)
        .nil(262)
        .call(TD, &[key1, e1], Some((10, RateLimitUnit::Day)), 1)
        .check(276, Check::Limit(10, Unit::Day))
        .hits(284, "test-domain.key1_value1.subkey1_something", 1)
        .counters([285, 286, 287], "test-domain.key1_value1.subkey1_something")
        .call(TD, &[key1, e1], Some((42, RateLimitUnit::Hour)), 1)
        .check(303, Check::Limit(42, Unit::Hour))
        .hits(307, "test-domain.key1_value1.subkey1_something", 2)
        .counters([308, 309, 310], "test-domain.key1_value1.subkey1_something");
    c.call(TD, &[key1, ("subkey1", "something_else")], Some((42, RateLimitUnit::Hour)), 1)
        .check(322, Check::Limit(42, Unit::Hour))
        .hits(330, "test-domain.key1_value1.subkey1_something_else", 1)
        .counters([331, 332, 333], "test-domain.key1_value1.subkey1_something_else")
}

/// TestShadowModeConfig, shadowmode_config.yaml. Their hand-made `shadow_mode`
/// increments are, here, one call over the shadow limit (after spending the rest).
fn shadow_mode() -> Case {
    let (k, kv) = ("test-domain.key1_value1.subkey1", "test-domain.key1_value1.subkey1_subvalue1");
    let sub = [("key1", "value1"), ("subkey1", "subvalue1")];
    let c = Case::new("TestShadowModeConfig", fixtures(&["shadowmode_config.yaml"]))
        .ask(TD, &[("key1", "value1"), ("subkey1", "something")])
        .rlconfig(516, k, false)
        .rpu(517, 5)
        .unit(518, Unit::Second)
        .hits(519, k, 1)
        .count(520, &format!("{k}.over_limit"), Count::Named)
        .count(521, &format!("{k}.near_limit"), Count::Named)
        .count(522, &format!("{k}.shadow_mode"), Count::Exactly(0))
        .ask(TD, &sub)
        .rlconfig(534, kv, true)
        .rpu(535, 10)
        .unit(536, Unit::Second)
        .hits(537, kv, 1)
        .count(538, &format!("{kv}.over_limit"), Count::Named)
        .count(539, &format!("{kv}.near_limit"), Count::Named)
        .over_shadow(&sub, kv)
        .count(540, &format!("{kv}.shadow_mode"), Count::Exactly(1));
    c.ask(TD, &[("key2", "something")])
        .rlconfig(551, "test-domain.key2", true)
        .rpu(552, 20)
        .unit(553, Unit::Minute)
        .hits(554, "test-domain.key2", 1)
        .count(555, "test-domain.key2.over_limit", Count::Named)
        .count(556, "test-domain.key2.near_limit", Count::Named)
        .over_shadow(&[("key2", "something")], "test-domain.key2")
        .count(557, "test-domain.key2.shadow_mode", Count::Exactly(1))
        .ask(TD, &[("key2", "value2")])
        .rlconfig(567, "test-domain.key2_value2", false)
        .rpu(568, 30)
        .unit(569, Unit::Minute)
        .hits(570, "test-domain.key2_value2", 1)
        .count(571, "test-domain.key2_value2.over_limit", Count::Named)
        .count(572, "test-domain.key2_value2.near_limit", Count::Named)
        .count(573, "test-domain.key2_value2.shadow_mode", Count::Exactly(0))
}

/// TestWildcardConfig, wildcard.yaml.
fn wildcard() -> Case {
    let c = Case::new("TestWildcardConfig", fixtures(&["wildcard.yaml"]))
        .ask(TD, &[("noVal", "foo1")])
        .some(593)
        .ask(TD, &[("noVal", "foo2")])
        .check(594, Check::SameLimit)
        .hits(596, "test-domain.noVal", 2)
        .hits(598, "test-domain.noVal", 2)
        .ask(TD, &[("wild", "foo1")])
        .some(616)
        .ask(TD, &[("wild", "foo2")])
        .check(617, Check::SameLimit)
        .hits(618, "test-domain.wild_foo*", 2)
        .hits(620, "test-domain.wild_foo*", 2)
        .ask(TD, &[("nestedWild", "val1"), ("wild", "goo2")])
        .some(621)
        .hits(622, "test-domain.nestedWild_val1.wild_goo*", 1)
        .none_for(631, TD, &[("wild", "bar")])
        .none_for(639, TD, &[("noWild", "foo1")]);
    c.ask(TD, &[("midWild", "barab")])
        .some(652)
        .ask(TD, &[("midWild", "bar123b")])
        .some(653)
        .check(654, Check::SameLimit)
        .hits(655, "test-domain.midWild_bar*b", 2)
        .ask(TD, &[("midWild", "barb")])
        .some(664)
        .none_for(677, TD, &[("midWild", "bara")])
        .none_for(678, TD, &[("midWild", "xbarb")])
        .ask(TD, &[("multiWild", "foo123bar456baz")])
        .some(691)
        .ask(TD, &[("multiWild", "foobarbaz")])
        .some(692)
        .check(693, Check::SameLimit)
        .hits(694, "test-domain.multiWild_foo*bar*baz", 2)
        .none_for(708, TD, &[("multiWild", "foo123baz")])
        .none_for(709, TD, &[("multiWild", "bar456baz")])
}

/// A rule of `rpu` a minute, as their inline configs write `YamlRateLimit`.
macro_rules! per_minute {
    ($rpu:literal) => {
        concat!("rate_limit: {unit: minute, requests_per_unit: ", $rpu, "}")
    };
}

/// TestDetailedMetric's four small configs (each its own domain here, `nested1` to
/// `nested4`, for their `nested`) and its `realisticExampleConfig` (`nested`).
fn detailed_metric_files() -> Vec<(String, String)> {
    let small = |n: u32, top: bool, below: bool| {
        format!(
            "domain: nested{n}\ndescriptors:\n  - key: key-1\n    detailed_metric: {top}\n    {}\n    descriptors:\n      - key: key-2\n        detailed_metric: {below}\n        {}\n",
            per_minute!(100),
            per_minute!(5)
        )
    };
    let realistic = concat!(
        "domain: nested\ndescriptors:\n",
        "  - {key: key_1, detailed_metric: true, ",
        per_minute!(500),
        "}\n",
        "  - {key: key_1, value: some-value-for-key-1, ",
        per_minute!(500),
        "}\n",
        "  - key: key_2\n    detailed_metric: true\n    ",
        per_minute!(5000),
        "\n    descriptors:\n",
        "      - {key: key_3, detailed_metric: true}\n",
        "      - {key: key_3, value: requested-key3-value, detailed_metric: true, ",
        per_minute!(5),
        "}\n",
        "  - key: key_2\n    value: specific-id\n    detailed_metric: true\n    ",
        per_minute!(50000),
        "\n    descriptors:\n",
        "      - {key: key_3, detailed_metric: true}\n",
        "      - {key: key_3, value: requested-key3-value, detailed_metric: true, ",
        per_minute!(100),
        "}\n",
    );
    let mut files: Vec<_> = [(1, true, false), (2, false, false), (3, true, true), (4, false, false)]
        .iter()
        .map(|&(n, top, below)| (format!("nested{n}.yaml"), small(n, top, below)))
        .collect();
    files.push(("nested.yaml".to_string(), realistic.to_string()));
    files
}

/// A descriptor's entries.
type Entries = &'static [(&'static str, &'static str)];

/// TestDetailedMetric: each sub-test's `NotNil` (line 1021) and stats key (1022, named
/// here by the line of its `expectedStatsKey`).
fn detailed_metric() -> Case {
    let subtests: [(u32, &'static str, Entries, &str); 7] = [
        (829, "nested1", &[("key-1", "value-1")], "nested1.key-1_value-1"),
        (867, "nested2", &[("key-1", "value-1")], "nested2.key-1"),
        (910, "nested3", &[("key-1", "value-1"), ("key-2", "value-2")], "nested3.key-1_value-1.key-2_value-2"),
        (953, "nested4", &[("key-1", "value-1"), ("key-2", "value-2")], "nested4.key-1.key-2"),
        (970, "nested", &[("key_1", "value-for-key-1")], "nested.key_1_value-for-key-1"),
        (987, "nested", &[("key_2", "key-2-value")], "nested.key_2_key-2-value"),
        (
            1008,
            "nested",
            &[("key_2", "key-2-value"), ("key_3", "requested-key3-value")],
            "nested.key_2_key-2-value.key_3_requested-key3-value",
        ),
    ];
    let mut c = Case::new("TestDetailedMetric", detailed_metric_files());
    for (line, domain, entries, key) in subtests {
        c = c.ask(domain, entries).some(1021).hits(line, key, 1);
    }
    c
}

/// `route` > `http_method` > `subject_id` (60 a minute) in `domain`, with these flags on
/// the three (`value_to_metric: true` or `detailed_metric: true`).
fn route_method_subject(domain: &str, flags: [&str; 3]) -> String {
    // a flag on its own line, at this indent
    let flag = |f: &str, indent: usize| if f.is_empty() { String::new() } else { format!("\n{:indent$}{f}: true", "") };
    let leaf = if flags[2].is_empty() { String::new() } else { format!(", {}: true", flags[2]) };
    format!(
        "domain: {domain}\ndescriptors:\n  - key: route{}\n    descriptors:\n      - key: http_method{}\n        descriptors:\n          - {{key: subject_id{leaf}, {}}}\n",
        flag(flags[0], 4),
        flag(flags[1], 8),
        per_minute!(60)
    )
}

const VTM: &str = "value_to_metric";

/// `domain: NAME` with the rules written in `rules`, as one inline file.
fn domain_file(name: &str, rules: &str) -> Vec<(String, String)> {
    inline(&format!("domain: {name}\ndescriptors:\n{rules}"))
}

/// The `TestValueToMetric_*` functions, one case each.
fn value_to_metric() -> Vec<Case> {
    let rms = [("route", "draw"), ("http_method", "GET"), ("subject_id", "123")];
    let chain = |flags: [&str; 2], limit: &str| {
        format!(
            "  - key: k1{}\n    descriptors:\n      - key: k2{}\n        descriptors:\n          - {{key: k3, {limit}}}\n",
            flags[0].replace(", ", "\n    "),
            flags[1].replace(", ", "\n        ")
        )
    };
    let one_per_second = "rate_limit: {unit: second, requests_per_unit: 1}";
    let two_levels = |flag: &str| {
        format!(
            "  - key: k1{}\n    descriptors:\n      - {{key: k2, {one_per_second}}}\n",
            flag.replace(", ", "\n    ")
        )
    };
    let default_key = two_levels(", value_to_metric: true");
    vec![
        Case::new(
            "TestValueToMetric_UsesRuntimeValuesInStats",
            inline(&route_method_subject("domain", [VTM, VTM, ""])),
        )
        .ask("domain", &rms)
        .some(1073)
        .hits(1077, "domain.route_draw.http_method_GET.subject_id", 1)
        .hits(1083, "domain.route_draw.http_method_GET.subject_id", 1)
        .count(1084, "domain.route_draw.http_method_GET.subject_id.within_limit", Count::Named),
        Case::new("TestValueToMetric_DefaultKeyIncludesValueAtThatLevel", domain_file("d", &default_key))
            .ask("d", &[("k1", "A"), ("k2", "foo")])
            .some(1123)
            .hits(1124, "d.k1_A.k2", 1),
        Case::new(
            "TestValueToMetric_MidLevelOnly",
            domain_file("d", &chain(["", ", value_to_metric: true"], one_per_second)),
        )
        .ask("d", &[("k1", "X"), ("k2", "Y"), ("k3", "Z")])
        .some(1166)
        .hits(1168, "d.k1.k2_Y.k3", 1),
        Case::new("TestValueToMetric_NoFlag_Unchanged", domain_file("d", &two_levels("")))
            .ask("d", &[("k1", "X"), ("k2", "Y")])
            .some(1203)
            .hits(1205, "d.k1.k2", 1),
        Case::new(
            "TestValueToMetric_DoesNotOverrideDetailedMetric",
            inline(&route_method_subject("domain", [VTM, VTM, "detailed_metric"])),
        )
        .ask("domain", &rms)
        .some(1255)
        .hits(1259, "domain.route_draw.http_method_GET.subject_id_123", 1)
        .hits(1262, "domain.route_draw.http_method_GET.subject_id_123", 1),
        configured_values(),
        with_wildcard(),
        with_empty_value(),
        full_key_matches_stats_key(),
    ]
}

/// TestValueToMetric_WithConfiguredValues.
fn configured_values() -> Case {
    let rules = concat!(
        "  - key: route\n    value_to_metric: true\n    descriptors:\n",
        "      - key: http_method\n        value: GET\n        value_to_metric: true\n        descriptors:\n",
        "          - {key: subject_id, ",
        per_minute!(60),
        "}\n",
        "      - key: http_method\n        value: POST\n        value_to_metric: true\n        descriptors:\n",
        "          - {key: subject_id, ",
        per_minute!(30),
        "}\n",
    );
    Case::new("TestValueToMetric_WithConfiguredValues", domain_file(TD, rules))
        .ask(TD, &[("route", "api"), ("http_method", "GET"), ("subject_id", "user123")])
        .some(1327)
        .rpu(1328, 60)
        .hits(1331, "test-domain.route_api.http_method_GET.subject_id", 1)
        .ask(TD, &[("route", "api"), ("http_method", "POST"), ("subject_id", "user456")])
        .some(1344)
        .rpu(1345, 30)
        .hits(1347, "test-domain.route_api.http_method_POST.subject_id", 1)
        .hits(1351, "test-domain.route_api.http_method_POST.subject_id", 1)
}

/// TestValueToMetric_WithWildcard.
fn with_wildcard() -> Case {
    let rules = concat!(
        "  - key: user\n    value_to_metric: true\n    descriptors:\n",
        "      - key: action\n        value: read*\n        value_to_metric: true\n        descriptors:\n",
        "          - {key: resource, ",
        per_minute!(100),
        "}\n",
    );
    Case::new("TestValueToMetric_WithWildcard", domain_file("domain", rules))
        .ask("domain", &[("user", "alice"), ("action", "readfile"), ("resource", "documents")])
        .some(1402)
        .rpu(1403, 100)
        .hits(1406, "domain.user_alice.action_readfile.resource", 1)
        .ask("domain", &[("user", "bob"), ("action", "readdata"), ("resource", "database")])
        .some(1419)
        .hits(1421, "domain.user_bob.action_readdata.resource", 1)
        .hits(1425, "domain.user_bob.action_readdata.resource", 1)
}

/// TestValueToMetric_WithEmptyValue.
fn with_empty_value() -> Case {
    let both = "domain.route.http_method.subject_id";
    Case::new("TestValueToMetric_WithEmptyValue", inline(&route_method_subject("domain", [VTM, VTM, ""])))
        .ask("domain", &[("route", ""), ("http_method", "GET"), ("subject_id", "123")])
        .some(1475)
        .hits(1479, "domain.route.http_method_GET.subject_id", 1)
        .ask("domain", &[("route", "draw"), ("http_method", ""), ("subject_id", "123")])
        .some(1492)
        .hits(1496, "domain.route_draw.http_method.subject_id", 1)
        .ask("domain", &[("route", ""), ("http_method", ""), ("subject_id", "123")])
        .some(1509)
        .hits(1513, both, 1)
        .hits(1519, both, 1)
        .count(1520, &format!("{both}.within_limit"), Count::Named)
}

/// TestValueToMetric_FullKeyMatchesStatsKey: three domains, in three files.
fn full_key_matches_stats_key() -> Case {
    let files = vec![
        ("1.yaml".to_string(), route_method_subject(TD, [VTM, VTM, ""])),
        ("2.yaml".to_string(), route_method_subject("test-domain-2", ["", "", ""])),
        ("3.yaml".to_string(), route_method_subject("test-domain-3", ["", "", "detailed_metric"])),
    ];
    let entries = [("route", "api"), ("http_method", "GET"), ("subject_id", "user123")];
    Case::new("TestValueToMetric_FullKeyMatchesStatsKey", files)
        .ask(TD, &entries)
        .some(1573)
        .hits(1577, "test-domain.route_api.http_method_GET.subject_id", 1)
        .ask("test-domain-2", &entries)
        .some(1619)
        .ask("test-domain-3", &entries)
        .some(1663)
}

/// TestShareThreshold, share_threshold.yaml: cases 1 to 4.
fn share_threshold() -> Case {
    let mut c = Case::new("TestShareThreshold", fixtures(&["share_threshold.yaml"]));
    for (i, value) in ["files/a.pdf", "files/b.csv", "files/c.txt"].into_iter().enumerate() {
        c = c.ask(TD, &[("files", value)]).some(1685).rpu(1688, 100).hits(
            1691,
            "test-domain.files_files/*",
            i as u64 + 1,
        );
    }
    c = c
        .hits(1697, "test-domain.files_files/*", 3)
        .ask(TD, &[("route", "api/v1"), ("method", "GET")])
        .some(1715)
        .hits(1717, "test-domain.route_api/*.method", 1)
        .ask(TD, &[("service", "svc/user"), ("endpoint", "get")])
        .some(1730)
        .hits(1733, "test-domain.service_svc/*.endpoint_get", 1)
        .ask(TD, &[("nested", "parent"), ("files", "nested/file1.txt")])
        .some(1748)
        .rpu(1750, 200)
        .hits(1752, "test-domain.nested_parent.files_nested/*", 1)
        .ask(TD, &[("files", "top/file1.txt"), ("files", "nested/file1.txt")])
        .some(1764)
        .hits(1768, "test-domain.files_top/*.files_nested/*", 1)
        .ask(TD, &[("path", "path/foo"), ("file", "file/doc1"), ("type", "pdf")])
        .some(1781)
        .hits(1786, "test-domain.path_path/*.file_file/*.type", 1)
        .ask(TD, &[("user", "user/alice"), ("resource", "res/file1"), ("action", "read")])
        .some(1799)
        .hits(1804, "test-domain.user_user/*.resource_res/*.action", 1)
        .ask(TD, &[("file", "test1")])
        .some(1819)
        .rpu(1820, 50)
        .hits(1824, "test-domain.file_test1", 1);
    for (i, value) in ["test2", "test23", "test123"].into_iter().enumerate() {
        c = c.ask(TD, &[("file", value)]).some(1838).rpu(1844, 100).hits(1847, "test-domain.file_test*", i as u64 + 1);
    }
    let at_least = |n| Count::AtLeast(n);
    c = c.hits(1854, "test-domain.file_test*", 3).count(1862, "test-domain.file_test*.total_hits", at_least(3)).count(
        1867,
        "test-domain.file_test1.total_hits",
        at_least(1),
    );
    share_threshold_wildcards(c)
}

/// TestShareThreshold, cases 5 to 8: middle and multiple wildcards.
fn share_threshold_wildcards(mut c: Case) -> Case {
    for (i, value) in ["/api/v1", "/api-beta-v1", "/apiXYZv1"].into_iter().enumerate() {
        c = c.ask(TD, &[("midpath", value)]).some(1881).rpu(1884, 100).hits(
            1885,
            "test-domain.midpath_/api*v1",
            i as u64 + 1,
        );
    }
    c = c.hits(1890, "test-domain.midpath_/api*v1", 3).none_for(1899, TD, &[("midpath", "/api/v2")]);
    for (i, value) in ["svcAepBrpc", "svcXXXepYYYrpc", "svceprpc"].into_iter().enumerate() {
        let key = "test-domain.multiroute_svc*ep*rpc";
        c = c.ask(TD, &[("multiroute", value)]).some(1913).rpu(1916, 50).hits(1917, key, i as u64 + 1);
    }
    c.hits(1922, "test-domain.multiroute_svc*ep*rpc", 3)
        .none_for(1931, TD, &[("multiroute", "svcABCrpc")])
        .ask(TD, &[("midroute", "/api/v2")])
        .some(1946)
        .ask(TD, &[("midroute", "/api-beta-v2")])
        .some(1947)
        .hits(1949, "test-domain.midroute_/api*v2", 2)
        .hits(1950, "test-domain.midroute_/api*v2", 2)
        .ask(TD, &[("tenant", "t1prod"), ("resource", "resAv2")])
        .some(1963)
        .hits(1966, "test-domain.tenant_t*prod.resource_res*v2", 1)
        .ask(TD, &[("tenant", "t99prod"), ("resource", "resBBBv2")])
        .some(1978)
        .hits(1979, "test-domain.tenant_t*prod.resource_res*v2", 2)
}

/// TestWildcardStatsBehavior: seven inline configs, each its own domain here
/// (`test-domain-1` to `test-domain-7`, for their `test-domain`).
fn wildcard_stats_behavior() -> Case {
    let rule =
        |value: &str, flags: &str| format!("  - {{key: wild, value: \"{value}\"{flags}, {}}}\n", per_minute!(20));
    let nested = format!(
        "  - key: wild\n    value: \"foo*\"\n    descriptors:\n      - key: other\n        value_to_metric: true\n        descriptors:\n          - {{key: limit, {}}}\n",
        per_minute!(20)
    );
    let rules = [
        rule("foo*", ""),
        rule("foo*", ", value_to_metric: true"),
        rule("foo*", ", share_threshold: true"),
        rule("foo*", ", share_threshold: true, value_to_metric: true"),
        nested,
        rule("foo*bar*", ""),
        rule("foo*bar*", ", value_to_metric: true"),
    ];
    let files = rules
        .iter()
        .enumerate()
        .map(|(i, r)| (format!("{}.yaml", i + 1), format!("domain: test-domain-{}\ndescriptors:\n{r}", i + 1)))
        .collect();
    let foo1 = [("wild", "foo1")];
    Case::new("TestWildcardStatsBehavior", files)
        .ask("test-domain-1", &foo1)
        .some(2016)
        .hits(2017, "test-domain-1.wild_foo*", 1)
        .ask("test-domain-2", &foo1)
        .some(2047)
        .hits(2048, "test-domain-2.wild_foo1", 1)
        .ask("test-domain-3", &foo1)
        .some(2077)
        .hits(2078, "test-domain-3.wild_foo*", 1)
        .ask("test-domain-4", &foo1)
        .some(2109)
        .hits(2110, "test-domain-4.wild_foo*", 1)
        .ask("test-domain-5", &[("wild", "foo1"), ("other", "bar"), ("limit", "X")])
        .some(2153)
        .hits(2155, "test-domain-5.wild_foo*.other_bar.limit", 1)
        .ask("test-domain-6", &[("wild", "foo123bar456")])
        .ask("test-domain-6", &[("wild", "fooXbarY")])
        .some(2183)
        .hits(2184, "test-domain-6.wild_foo*bar*", 2)
        .hits(2185, "test-domain-6.wild_foo*bar*", 2)
        .ask("test-domain-7", &[("wild", "foo123bar456")])
        .some(2204)
        .hits(2205, "test-domain-7.wild_foo123bar456", 1)
}

/// TestMetadata, metadata.yaml: a rule's `metadata` is seen in the response's
/// `dynamic_metadata` (`envoy.response_dynamic_metadata`).
fn metadata() -> Case {
    let k = "test-domain.key1_value1.subkey1";
    let mut c = Case::new("TestMetadata", fixtures(&["metadata.yaml"]));
    c.extra = "envoy: {response_dynamic_metadata: true}\n";
    c.none_for(2215, TD, &[])
        .count(2216, "test-domain.domain_not_found", Count::Exactly(0))
        .ask(TD, &[("key1", "value1"), ("subkey1", "something")])
        .rpu(2227, 5)
        .unit(2228, Unit::Second)
        .hits(2229, k, 1)
        .counters([2230, 2231, 2232], k)
        .meta(2235, &[], None)
        .meta(2237, &["name"], None)
        .meta(2238, &["name"], Some("service_1"))
        .ask(TD, &[("key2", "something")])
        .rpu(2249, 20)
        .unit(2250, Unit::Minute)
        .hits(2251, "test-domain.key2", 1)
        .counters([2252, 2253, 2254], "test-domain.key2")
        .meta(2256, &[], None)
        .meta(2258, &["service_with_quota"], None)
        .meta(2259, &["service_with_quota", "name"], Some("service_2"))
}

/// A set of files their loader refuses (`expectConfigPanic`): the Go test, the line of
/// its expected error, the files, whether domains merge, their error text, and what
/// Sluice's message must say for the same thing in substance.
struct Refusal {
    test: &'static str,
    line: u32,
    files: &'static [&'static str],
    merge: bool,
    theirs: &'static str,
    says: &'static [&'static str],
}

const fn refusal(
    test: &'static str,
    line: u32,
    files: &'static [&'static str],
    theirs: &'static str,
    says: &'static [&'static str],
) -> Refusal {
    Refusal { test, line, files, merge: false, theirs, says }
}

const REFUSALS: [Refusal; 14] = [
    refusal(
        "TestEmptyDomain",
        354,
        &["empty_domain.yaml"],
        "config file cannot have empty domain",
        &["empty_domain.yaml", "`domain`"],
    ),
    refusal(
        "TestDuplicateDomain",
        365,
        &["basic_config.yaml", "duplicate_domain.yaml"],
        "duplicate domain 'test-domain' in config file",
        &["duplicate_domain.yaml", "domain 'test-domain' is also defined"],
    ),
    refusal("TestEmptyKey", 376, &["empty_key.yaml"], "descriptor has empty key", &["empty_key.yaml", "`key`"]),
    refusal(
        "TestDuplicateKey",
        387,
        &["duplicate_key.yaml"],
        "duplicate descriptor composite key 'test-domain.key1_value1'",
        &["duplicate_key.yaml", "test-domain", "`key1: value1` is defined twice"],
    ),
    Refusal {
        test: "TestDuplicateKeyDomainMerge",
        line: 400,
        files: &["merge_domain_key1.yaml", "merge_domain_key1.yaml"],
        merge: true,
        theirs: "duplicate descriptor composite key 'test-domain.key1_value1'",
        says: &["merge_domain_key1.yaml", "`key1: value1` of domain 'test-domain' is also defined"],
    },
    refusal(
        "TestBadLimitUnit",
        411,
        &["bad_limit_unit.yaml"],
        "invalid rate limit unit 'foo'",
        &["bad_limit_unit.yaml", "unknown unit `foo`"],
    ),
    refusal(
        "TestReplacesSelf",
        422,
        &["replaces_self.yaml"],
        "replaces should not contain name of same descriptor",
        &["replaces_self.yaml", "lists itself in `replaces`"],
    ),
    refusal(
        "TestReplacesEmpty",
        433,
        &["replaces_empty.yaml"],
        "should not have an empty replaces entry",
        &["replaces_empty.yaml", "replaces[0]", "invalid name ``"],
    ),
    refusal(
        "TestBadYaml",
        444,
        &["bad_yaml.yaml"],
        "error loading config file: yaml: line 2: found unexpected end of stream",
        &["bad_yaml.yaml:2:", "found unexpected end of stream"],
    ),
    refusal(
        "TestMisspelledKey",
        455,
        &["misspelled_key.yaml"],
        "config error, unknown key 'ratelimit'",
        &["misspelled_key.yaml", "unknown field `ratelimit`"],
    ),
    refusal(
        "TestMisspelledKey",
        464,
        &["misspelled_key2.yaml"],
        "config error, unknown key 'requestsperunit'",
        &["misspelled_key2.yaml", "unknown field `requestsperunit`"],
    ),
    refusal(
        "TestNonStringKey",
        475,
        &["non_string_key.yaml"],
        "config error, key is not of type string: 0.25",
        &["non_string_key.yaml", "0.25"],
    ),
    refusal(
        "TestNonMapList",
        486,
        &["non_map_list.yaml"],
        "config error, yaml file contains list of type other than map: a",
        &["non_map_list.yaml", "string \"a\"", "expected struct"],
    ),
    refusal(
        "TestUnlimitedWithRateLimitUnit",
        497,
        &["unlimited_with_unit.yaml"],
        "should not specify rate limit unit when unlimited",
        &["unlimited_with_unit.yaml", "`unlimited: true` rate_limit takes no `unit`"],
    ),
];

/// One expectation's outcome: `Err` holds what Sluice answered instead.
struct Outcome {
    test: &'static str,
    line: u32,
    want: String,
    got: Result<(), String>,
}

/// Writes `files` into `dir` (a file named twice is written again under `_again`, as
/// their test loads one file twice).
fn write_files(dir: &std::path::Path, files: &[(String, String)]) {
    for (name, text) in files {
        let mut path = dir.join(name);
        if path.exists() {
            path = dir.join(name.replace(".yaml", "_again.yaml"));
        }
        std::fs::write(path, text).unwrap();
    }
}

/// `sluice config check` of a config loading only `r.files`: refused, and saying so.
fn run_refusal(r: &Refusal) -> [Outcome; 2] {
    let dir = TempDir::new("sluice-their-refusal");
    let domains = dir.path().join("domains");
    std::fs::create_dir(&domains).unwrap();
    write_files(&domains, &fixtures(r.files));
    let config = dir.path().join("sluice.yaml");
    let merge = if r.merge { "envoy: {merge_domains: true}\n" } else { "" };
    std::fs::write(&config, format!("domains_from: \"{}\"\n{merge}", domains.display())).unwrap();
    let out = std::process::Command::new(common::bin()).args(["config", "check"]).arg(&config).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
    let refused = if out.status.success() { Err(format!("loaded ({err})")) } else { Ok(()) };
    let missing: Vec<_> = r.says.iter().filter(|s| !err.contains(*s)).collect();
    let says = if missing.is_empty() { Ok(()) } else { Err(format!("{err:?}, without {missing:?}")) };
    let outcome = |want: String, got| Outcome { test: r.test, line: r.line, want, got };
    [
        outcome(format!("{} refused", r.files.join(" + ")), refused),
        outcome(format!("error {:?} (here: {:?})", r.theirs, r.says), says),
    ]
}

/// A running Sluice for one case, and what its calls answered.
struct Run {
    sluice: common::Sluice,
    rls: envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<
        tonic::transport::Channel,
    >,
    debug: String,
    answers: Vec<RateLimitResponse>,
}

impl Run {
    async fn start(case: &Case, dir: &TempDir) -> Run {
        write_files(dir.path(), &case.files);
        let sections = format!("  debug: 127.0.0.1:0\ndomains_from: \"{}\"\n{}", dir.path().display(), case.extra);
        let sluice = common::start_with(&sections, "  []\n");
        let ready = std::fs::read_to_string(sluice.dir.path().join("ready")).unwrap();
        let debug = ready.lines().find_map(|l| l.strip_prefix("debug=")).expect("a debug= line").to_string();
        let rls = common::rls(&sluice.grpc).await;
        Run { sluice, rls, debug, answers: Vec::new() }
    }

    async fn ask(&mut self, domain: &str, entries: &[(&str, &str)], limit: Option<(u32, RateLimitUnit)>, hits: u32) {
        let descriptor = RateLimitDescriptor {
            entries: entries.iter().map(|(k, v)| Entry { key: (*k).into(), value: (*v).into() }).collect(),
            limit: limit.map(|(requests_per_unit, unit)| RateLimitOverride { requests_per_unit, unit: unit as i32 }),
            ..Default::default()
        };
        let request = RateLimitRequest { domain: domain.into(), descriptors: vec![descriptor], hits_addend: hits };
        let answer = match self.rls.should_rate_limit(request).await {
            Ok(r) => r.into_inner(),
            // an error is an answer with no status: every limit check then says so
            Err(status) => RateLimitResponse { raw_body: status.message().as_bytes().to_vec(), ..Default::default() },
        };
        self.answers.push(answer);
    }

    /// See [`Step::OverShadow`]: at most 50 calls (their shadow limits are 10 and 20).
    async fn over_shadow(&mut self, entries: &[(&str, &str)], key: &str) {
        for _ in 0..50 {
            let stats = self.get(format!("http://{}/stats", self.debug)).await;
            if stat_value(&stats, &format!("{key}.shadow_mode")).unwrap_or(0) > 0 {
                return;
            }
            self.ask(TD, entries, None, 1).await;
        }
    }

    async fn get(&self, url: String) -> String {
        reqwest::get(url).await.unwrap().text().await.unwrap()
    }
}

/// The limit of the last answer's first status, as `(code, limit)`, or what went wrong.
fn last_limit(run: &Run) -> Result<(i32, Option<RateLimit>), String> {
    let answer = run.answers.last().ok_or("no call made")?;
    match answer.statuses.first() {
        Some(s) => Ok((s.code, s.current_limit.clone())),
        None => Err(format!("no status (error: {:?})", String::from_utf8_lossy(&answer.raw_body))),
    }
}

/// A limit as their test would print it.
fn show(limit: &Option<RateLimit>) -> String {
    match limit {
        None => "no limit".into(),
        Some(l) => format!("{} per {:?}, name {:?}", l.requests_per_unit, l.unit(), l.name),
    }
}

/// Checks of the last answer's limit.
fn check_limit(run: &Run, check: &Check) -> Result<(), String> {
    let (code, limit) = last_limit(run)?;
    let answered = format!("code {:?}, {}", Code::try_from(code).unwrap_or(Code::Unknown), show(&limit));
    let ok = match (check, &limit) {
        (Check::NoLimit | Check::Unlimited, None) => code == Code::Ok as i32,
        (Check::SomeLimit, Some(_)) => true,
        (Check::Rpu(n), Some(l)) => l.requests_per_unit == *n,
        (Check::Unit(u), Some(l)) => l.unit() == *u,
        (Check::Name(n), Some(l)) => l.name == *n,
        (Check::Limit(n, u), Some(l)) => l.requests_per_unit == *n && l.unit() == *u && l.name.is_empty(),
        (Check::SameLimit, Some(_)) => {
            let before = run.answers.iter().rev().nth(1).and_then(|a| a.statuses.first());
            before.is_some_and(|s| s.current_limit == limit)
        }
        _ => false,
    };
    if ok { Ok(()) } else { Err(answered) }
}

/// What their test expects, in words.
fn describe(check: &Check) -> String {
    match check {
        Check::Rpu(n) => format!("RequestsPerUnit {n}"),
        Check::Unit(u) => format!("Unit {u:?}"),
        Check::Name(n) => format!("Name {n:?}"),
        Check::Limit(n, u) => format!("Limit {{RequestsPerUnit: {n}, Unit: {u:?}}}"),
        Check::NoLimit => "GetLimit nil (OK, no limit)".into(),
        Check::SomeLimit => "GetLimit not nil (a limit)".into(),
        Check::Unlimited => "Unlimited (OK, no limit)".into(),
        Check::SameLimit => "the same limit as the call before".into(),
        Check::Stat(name, Count::Exactly(n)) => format!("{name} = {n}"),
        Check::Stat(name, Count::AtLeast(n)) => format!("{name} >= {n}"),
        Check::Stat(name, Count::Named) => format!("a counter {name}"),
        Check::Rlconfig(key, shadow) => format!("rule {key} with ShadowMode {shadow}"),
        Check::Meta(path, want) => format!(
            "Metadata{}{}",
            path.iter().map(|p| format!(".{p}")).collect::<String>(),
            want.map(|w| format!(" = {w:?}")).unwrap_or_default()
        ),
    }
}

/// The value of their counter `name` in `/stats` (absent: none).
fn stat_value(stats: &str, name: &str) -> Option<u64> {
    let prefix = format!("{STAT}{name}: ");
    stats.lines().find_map(|l| l.strip_prefix(&prefix)?.parse().ok())
}

/// Where Sluice counts a name missing from `/stats`: its `sluice_decisions_detailed_total`
/// series for that descriptor (their key less the domain), summed over outcomes.
fn detailed_hits(metrics: &str, key: &str) -> Option<u64> {
    let (domain, descriptor) = key.split_once('.')?;
    let (d, l) = (format!("domain=\"{domain}\""), format!("descriptor=\"{descriptor}\""));
    let lines = metrics.lines().filter(|x| x.starts_with("sluice_decisions_detailed_total{"));
    let values: Vec<u64> = lines
        .filter(|x| x.contains(&d) && x.contains(&l))
        .filter_map(|x| x.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// A `/stats` check, saying (when it fails) what Sluice counts instead.
async fn check_stat(run: &Run, name: &str, count: &Count) -> Result<(), String> {
    let stats = run.get(format!("http://{}/stats", run.debug)).await;
    let value = stat_value(&stats, name);
    let ok = match (count, value) {
        (Count::Exactly(n), v) => v.unwrap_or(0) == *n,
        (Count::AtLeast(n), v) => v.unwrap_or(0) >= *n,
        (Count::Named, v) => v.is_some(),
    };
    if ok {
        return Ok(());
    }
    let mut said = match value {
        Some(v) => format!("{STAT}{name}: {v}"),
        None => format!("no {STAT}{name} in /stats"),
    };
    if let Some(key) = name.strip_suffix(".total_hits").filter(|_| value.is_none()) {
        let metrics = run.get(format!("{}/metrics", run.sluice.base)).await;
        said += &match detailed_hits(&metrics, key) {
            Some(n) => format!(" (counted {n} under that descriptor in sluice_decisions_detailed_total, /metrics)"),
            None => format!("; counted instead: {}", counted_in(&stats, &metrics, key.split('.').next().unwrap())),
        };
    }
    Err(said)
}

/// What the domain's hits were counted as: the non-zero `total_hits` of `/stats`, and
/// the `descriptor` labels of `sluice_decisions_detailed_total`.
fn counted_in(stats: &str, metrics: &str, domain: &str) -> String {
    let own = format!("{STAT}{domain}.");
    let stats = stats.lines().filter(|l| l.starts_with(&own) && l.contains(".total_hits: ") && !l.ends_with(": 0"));
    let label = |l: &str| Some(l.split("descriptor=\"").nth(1)?.split('"').next()?.to_string());
    let in_domain = format!("domain=\"{domain}\"");
    let detailed = metrics
        .lines()
        .filter(|l| l.starts_with("sluice_decisions_detailed_total{") && l.contains(&in_domain))
        .filter_map(|l| Some(format!("detailed descriptor {:?}: {}", label(l)?, l.rsplit(' ').next()?)));
    let all: Vec<String> = stats.map(|l| l.trim_start_matches(STAT).to_string()).chain(detailed).collect();
    all.join(", ")
}

/// `/rlconfig` has the rule `key` with this shadow mode.
async fn check_rlconfig(run: &Run, key: &str, shadow: bool) -> Result<(), String> {
    let rules = run.get(format!("http://{}/rlconfig", run.debug)).await;
    let line = rules.lines().find(|l| l.starts_with(&format!("{key}: ")));
    match line {
        Some(l) if l.contains(&format!("shadow_mode: {shadow},")) => Ok(()),
        Some(l) => Err(l.to_string()),
        None => Err(format!("no rule {key} in /rlconfig:\n{rules}")),
    }
}

/// The last answer's `dynamic_metadata` `metadata`, at `path`: a string, or a struct.
fn check_meta(run: &Run, path: &[&str], want: Option<&str>) -> Result<(), String> {
    use envoy_types::pb::google::protobuf::value::Kind;
    let answer = run.answers.last().ok_or("no call made")?;
    let meta = answer.dynamic_metadata.as_ref().ok_or("no dynamic_metadata")?;
    let mut at = meta.fields.get("metadata").ok_or(format!("no metadata in {meta:?}"))?;
    for p in path {
        let Some(Kind::StructValue(s)) = &at.kind else { return Err(format!("{at:?} is not a struct")) };
        at = s.fields.get(*p).ok_or(format!("no {p} in {s:?}"))?;
    }
    match (want, &at.kind) {
        (None, Some(_)) => Ok(()),
        (Some(w), Some(Kind::StringValue(s))) if s == w => Ok(()),
        (_, kind) => Err(format!("{kind:?}")),
    }
}

async fn evaluate(run: &Run, check: &Check) -> Result<(), String> {
    match check {
        Check::Stat(name, count) => check_stat(run, name, count).await,
        Check::Rlconfig(key, shadow) => check_rlconfig(run, key, *shadow).await,
        Check::Meta(path, want) => check_meta(run, path, *want),
        _ => check_limit(run, check),
    }
}

/// Runs a case on its own Sluice: its calls and checks, in order.
async fn run_case(case: Case) -> Vec<Outcome> {
    let dir = TempDir::new("sluice-their-config");
    let mut run = Run::start(&case, &dir).await;
    let mut outcomes = Vec::new();
    for step in &case.steps {
        match step {
            Step::Ask { domain, entries, limit, hits } => run.ask(domain, entries, *limit, *hits).await,
            Step::OverShadow { entries, key } => run.over_shadow(entries, key).await,
            Step::Check(line, check) => {
                let got = evaluate(&run, check).await;
                outcomes.push(Outcome { test: case.test, line: *line, want: describe(check), got });
            }
        }
    }
    outcomes
}

fn cases() -> Vec<Case> {
    let mut cases =
        vec![basic_config(), domain_merge(), limit_override(), shadow_mode(), wildcard(), detailed_metric()];
    cases.extend(value_to_metric());
    cases.extend([share_threshold(), wildcard_stats_behavior(), metadata()]);
    cases
}

/// How many expectations of each Go test hold, a line each, in their order.
fn by_test(outcomes: &[Outcome]) -> String {
    let mut tests: Vec<(&str, usize, usize)> = Vec::new();
    for o in outcomes {
        if tests.last().is_none_or(|t| t.0 != o.test) {
            tests.push((o.test, 0, 0));
        }
        let t = tests.last_mut().unwrap();
        t.1 += o.got.is_ok() as usize;
        t.2 += 1;
    }
    tests.iter().map(|(test, held, all)| format!("  {test}: {held} of {all}\n")).collect()
}

/// Every expectation of config_test.go seen from outside, checked against Sluice.
#[tokio::test]
async fn their_config_test_expectations_all_hold() {
    let mut outcomes = Vec::new();
    for case in cases() {
        outcomes.extend(run_case(case).await);
    }
    outcomes.extend(REFUSALS.iter().flat_map(run_refusal));
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| o.got.is_err()).collect();
    for o in &failed {
        let got = o.got.as_ref().unwrap_err();
        eprintln!("{} (config_test.go:{}): theirs expects {}; Sluice: {got}", o.test, o.line, o.want);
    }
    eprintln!("{}", by_test(&outcomes));
    let held = outcomes.len() - failed.len();
    eprintln!("{held} of {} of envoyproxy/ratelimit's config_test.go expectations hold", outcomes.len());
    assert!(failed.is_empty(), "{} of their expectations do not hold (listed above)", failed.len());
}
