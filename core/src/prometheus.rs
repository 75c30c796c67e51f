//! Prometheus text exposition, read line by line: the indexer scrapes engines with it, and tests
//! and the benchmark read the metrics of every kvroute process with it. Only what kvroute needs:
//! samples with their name, raw label list and value; `# HELP`/`# TYPE` lines and timestamps are
//! skipped.

/// One sample line: `name{labels} value [timestamp]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    /// The metric name (`vllm:num_requests_running`).
    pub name: &'a str,
    /// The label list between the braces, as written (`engine="0",model_name="qwen3"`); empty
    /// when the sample has none.
    pub labels: &'a str,
    /// The value (may be NaN or infinite, as the format allows).
    pub value: f64,
}

impl<'a> Sample<'a> {
    /// The value of label `key`, if present.
    pub fn label(&self, key: &str) -> Option<&'a str> {
        label(self.labels, key)
    }

    /// Whether this sample is the series written `name` or `name{labels}` (labels exactly as
    /// exposed).
    pub fn is_series(&self, series: &str) -> bool {
        match series.split_once('{') {
            Some((name, rest)) => name == self.name && rest.strip_suffix('}') == Some(self.labels),
            None => series == self.name && self.labels.is_empty(),
        }
    }
}

/// Every well-formed sample of `text`, in order; comment, blank and malformed lines are skipped.
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.lines().filter_map(sample)
}

/// The samples of `text` whose name `pick` maps to a series, with that series. A line's name is
/// read first, so the lines of other series (most of an engine's text: histogram buckets) cost a
/// name search and nothing more.
pub fn picked<'a, K>(
    text: &'a str,
    pick: impl Fn(&str) -> Option<K> + 'a,
) -> impl Iterator<Item = (K, Sample<'a>)> + 'a {
    text.lines().filter_map(move |line| {
        let (name, rest) = split_name(line)?;
        let series = pick(name)?;
        Some((series, sample_after(name, rest)?))
    })
}

/// Parses one line, `None` for comments, blank and malformed lines.
pub fn sample(line: &str) -> Option<Sample<'_>> {
    let (name, rest) = split_name(line)?;
    sample_after(name, rest)
}

/// A sample line's name and what follows it; `None` for comments and blank lines.
fn split_name(line: &str) -> Option<(&str, &str)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let i = line.find(['{', ' '])?;
    Some((&line[..i], &line[i..]))
}

/// The sample named `name` whose labels and value are `rest`.
fn sample_after<'a>(name: &'a str, rest: &'a str) -> Option<Sample<'a>> {
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inner) => {
            let j = inner.rfind('}')?;
            (&inner[..j], &inner[j + 1..])
        }
        None => ("", rest),
    };
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// The sum of every sample named `name`, whatever its labels; `None` when there is none.
pub fn sum(text: &str, name: &str) -> Option<f64> {
    samples(text)
        .filter(|s| s.name == name)
        .map(|s| s.value)
        .reduce(|a, b| a + b)
}

/// The value of label `name` in a label list (`a="x",b="y"`), if present.
pub fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let key = format!("{name}=\"");
    let start = labels
        .match_indices(&key)
        .find(|(i, _)| *i == 0 || labels.as_bytes()[i - 1] == b',')
        .map(|(i, m)| i + m.len())?;
    let rest = &labels[start..];
    Some(&rest[..rest.find('"')?])
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP vllm:num_requests_running Running.\n\
        # TYPE vllm:num_requests_running gauge\n\
        vllm:num_requests_running{engine=\"0\",model_name=\"qwen3\"} 2.0\n\
        vllm:num_requests_running{engine=\"1\",model_name=\"qwen3\"} 3\n\
        process_start_time_seconds 1.7e9\n\
        kvroute_x_total 4 1712345678000\n\
        broken{a=\"b\" \n\
        nan_one NaN\n";

    #[test]
    fn reads_names_labels_and_values() {
        let all: Vec<Sample> = samples(TEXT).collect();
        assert_eq!(all.len(), 5);
        assert_eq!(all[0].name, "vllm:num_requests_running");
        assert_eq!(all[0].label("engine"), Some("0"));
        assert_eq!(all[1].label("model_name"), Some("qwen3"));
        assert_eq!(all[1].value, 3.0);
        assert_eq!(all[2].labels, "");
        assert_eq!(all[3].value, 4.0, "the timestamp is not the value");
        assert!(all[4].value.is_nan());
    }

    #[test]
    fn picked_samples_are_the_samples_of_the_picked_names() {
        let pick = |name: &str| (name == "vllm:num_requests_running").then_some(7);
        let running: Vec<(i32, Sample)> = picked(TEXT, pick).collect();
        let all: Vec<(i32, Sample)> = samples(TEXT)
            .filter(|s| s.name == "vllm:num_requests_running")
            .map(|s| (7, s))
            .collect();
        assert_eq!(running, all);
        assert_eq!(running.len(), 2);
        assert_eq!(picked(TEXT, |n| (n == "broken").then_some(())).count(), 0);
    }

    #[test]
    fn sums_over_label_sets() {
        assert_eq!(sum(TEXT, "vllm:num_requests_running"), Some(5.0));
        assert_eq!(sum(TEXT, "vllm:num_requests"), None);
        assert_eq!(sum(TEXT, "absent"), None);
    }

    #[test]
    fn matches_a_series_exactly() {
        let first = samples(TEXT).next().expect("a sample");
        assert!(first.is_series("vllm:num_requests_running{engine=\"0\",model_name=\"qwen3\"}"));
        assert!(!first.is_series("vllm:num_requests_running{engine=\"0\"}"));
        assert!(!first.is_series("vllm:num_requests_running"));
    }

    #[test]
    fn labels_match_whole_keys_only() {
        assert_eq!(label("xengine=\"9\",engine=\"2\"", "engine"), Some("2"));
        assert_eq!(label("a=\"1\"", "engine"), None);
    }
}
