//! Chat templates rendered with minijinja the way Hugging Face transformers' `apply_chat_template`
//! renders them with Jinja2: `trim_blocks` and `lstrip_blocks` on, a `tojson` filter that behaves
//! like Python's `json.dumps` (transformers replaces Jinja's HTML-escaping one), the
//! `raise_exception` and `strftime_now` globals, and Python string methods (`startswith`, `split`,
//! `strip`, ...) through minijinja-contrib's pycompat layer.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};

use super::openai::detect_content_format;
use super::{ChatContentFormat, RequestError};

/// The template to use when the model names several: transformers picks `tool_use` when tools
/// are given and that name exists, else `default`.
const DEFAULT_NAME: &str = "default";
const TOOL_USE_NAME: &str = "tool_use";

/// A model's chat template(s), compiled once.
pub(crate) struct ChatTemplates {
    env: Environment<'static>,
    /// Template name -> source (a single unnamed template is stored as `default`).
    sources: BTreeMap<String, String>,
    /// Template name -> the content format its source expects (vLLM's detection, done once).
    formats: BTreeMap<String, ChatContentFormat>,
}

impl std::fmt::Debug for ChatTemplates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplates")
            .field("names", &self.sources.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl ChatTemplates {
    /// Reads `chat_template` from a parsed `tokenizer_config.json`: a string, or a list of
    /// `{"name", "template"}` objects. `None` when the config has none.
    pub(crate) fn from_tokenizer_config(
        config: &serde_json::Value,
    ) -> Result<Option<Self>, RequestError> {
        match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Self::single(s.clone()).map(Some),
            Some(serde_json::Value::Array(items)) => {
                let mut named = BTreeMap::new();
                for item in items {
                    let name = item.get("name").and_then(|v| v.as_str());
                    let template = item.get("template").and_then(|v| v.as_str());
                    match (name, template) {
                        (Some(n), Some(t)) => {
                            named.insert(n.to_owned(), t.to_owned());
                        }
                        _ => {
                            return Err(RequestError::ModelFiles(
                                "tokenizer_config.json: chat_template list entries need \"name\" and \"template\" strings".into(),
                            ))
                        }
                    }
                }
                Self::named(named).map(Some)
            }
            Some(_) => Err(RequestError::ModelFiles(
                "tokenizer_config.json: chat_template must be a string or a list".into(),
            )),
        }
    }

    /// One template, stored under the name `default`.
    pub(crate) fn single(source: String) -> Result<Self, RequestError> {
        let mut named = BTreeMap::new();
        named.insert(DEFAULT_NAME.to_owned(), source);
        Self::named(named)
    }

    fn named(sources: BTreeMap<String, String>) -> Result<Self, RequestError> {
        let mut env = new_environment()?;
        for (name, source) in &sources {
            env.add_template_owned(name.clone(), source.clone())
                .map_err(|e| RequestError::Template(describe(&e)))?;
        }
        let formats = sources
            .iter()
            .map(|(name, source)| (name.clone(), detect_content_format(source)))
            .collect();
        Ok(Self {
            env,
            sources,
            formats,
        })
    }

    /// The template name transformers would pick.
    pub(crate) fn select(&self, has_tools: bool) -> Result<&str, RequestError> {
        if has_tools && self.sources.contains_key(TOOL_USE_NAME) {
            return Ok(TOOL_USE_NAME);
        }
        if self.sources.contains_key(DEFAULT_NAME) {
            return Ok(DEFAULT_NAME);
        }
        Err(RequestError::Template(format!(
            "the model has several chat templates ({}) and none is named \"default\"",
            self.sources.keys().cloned().collect::<Vec<_>>().join(", ")
        )))
    }

    /// Every template, by name.
    pub(crate) fn sources(&self) -> &BTreeMap<String, String> {
        &self.sources
    }

    /// The source of a template returned by [`Self::select`].
    pub(crate) fn source(&self, name: &str) -> &str {
        self.sources.get(name).map(String::as_str).unwrap_or("")
    }

    /// The content format template `name` expects, as [`detect_content_format`] finds it.
    pub(crate) fn detected_format(&self, name: &str) -> ChatContentFormat {
        self.formats
            .get(name)
            .copied()
            .unwrap_or_else(|| detect_content_format(self.source(name)))
    }

    /// Renders template `name` with `context` (a JSON object of template variables).
    pub(crate) fn render(
        &self,
        name: &str,
        context: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, RequestError> {
        let template = self
            .env
            .get_template(name)
            .map_err(|e| RequestError::Template(describe(&e)))?;
        template
            .render(Value::from(minijinja::value::Serde(context)))
            .map_err(|e| RequestError::Template(describe(&e)))
    }
}

/// An error message without template source or variable values (which may hold prompt text).
fn describe(e: &Error) -> String {
    let mut msg = match e.detail() {
        Some(detail) => format!("{}: {detail}", e.kind()),
        None => e.kind().to_string(),
    };
    if let Some(line) = e.line() {
        let _ = write!(msg, " (template line {line})");
    }
    msg
}

/// A minijinja environment configured like transformers' Jinja2 sandbox.
fn new_environment() -> Result<Environment<'static>, RequestError> {
    let mut env = Environment::new();
    // Jinja2's defaults otherwise (keep_trailing_newline off, lenient undefined).
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .keep_trailing_newline(false)
        .build()
        .map_err(|e| RequestError::Template(describe(&e)))?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson_filter);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    Ok(env)
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)` with
/// transformers' defaults, all overridable by keyword.
fn tojson_filter(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => {
            if let Some(s) = v.as_str() {
                Some(s.to_owned())
            } else if let Some(n) = v.as_i64() {
                Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
            } else {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ));
            }
        }
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match (
                parts.first().and_then(|p| p.as_str()),
                parts.get(1).and_then(|p| p.as_str()),
            ) {
                (Some(a), Some(b)) if parts.len() == 2 => (a.to_owned(), b.to_owned()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
        _ => (
            if indent.is_some() { "," } else { ", " }.to_owned(),
            ": ".to_owned(),
        ),
    };
    let opts = PyJsonOptions {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    py_json(value, &opts, 0, &mut out)?;
    Ok(Value::from(out))
}

/// Options of Python's `json.dumps` that templates use.
pub(crate) struct PyJsonOptions {
    pub(crate) ensure_ascii: bool,
    pub(crate) indent: Option<String>,
    pub(crate) item_sep: String,
    pub(crate) key_sep: String,
    pub(crate) sort_keys: bool,
}

const MAX_JSON_DEPTH: usize = 128;

fn newline_indent(opts: &PyJsonOptions, depth: usize, out: &mut String) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

/// Serialises a template value exactly as Python's `json.dumps` would serialise the equivalent
/// Python object.
pub(crate) fn py_json(
    value: &Value,
    opts: &PyJsonOptions,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    if depth > MAX_JSON_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                out.push_str(&value.to_string());
            } else {
                let f = f64::try_from(value.clone()).map_err(|_| {
                    Error::new(ErrorKind::InvalidOperation, "tojson: unsupported number")
                })?;
                out.push_str(&py_float_repr(f));
            }
        }
        ValueKind::String => py_json_str(value.as_str().unwrap_or(""), opts.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(opts, depth + 1, out);
                py_json(item, opts, depth + 1, out)?;
            }
            newline_indent(opts, depth, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(opts, depth + 1, out);
                match key.kind() {
                    ValueKind::String => {
                        py_json_str(key.as_str().unwrap_or(""), opts.ensure_ascii, out)
                    }
                    // Python converts int/float/bool/None keys to their JSON text as a string.
                    _ => {
                        let mut k = String::new();
                        py_json(key, opts, depth + 1, &mut k)?;
                        py_json_str(&k, opts.ensure_ascii, out);
                    }
                }
                out.push_str(&opts.key_sep);
                let item = value.get_item(key)?;
                py_json(&item, opts, depth + 1, out)?;
            }
            newline_indent(opts, depth, out);
            out.push('}');
        }
        ValueKind::Bytes | ValueKind::Plain | ValueKind::Invalid => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "tojson: object of kind {} is not JSON serializable",
                    value.kind()
                ),
            ))
        }
        // ValueKind is non-exhaustive.
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: value is not JSON serializable",
            ))
        }
    }
    Ok(())
}

/// A JSON string literal as Python's `json.dumps` writes it.
fn py_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{:04x}", unit);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest round-trip digits, scientific notation when the
/// exponent is below -4 or at least 16, and always a `.0` or an exponent.
pub(crate) fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "d.ddddde[-]x".
    let sci = format!("{:e}", f);
    let (mantissa, exp) = match sci.split_once('e') {
        Some((m, e)) => (m, e.parse::<i32>().unwrap_or(0)),
        None => (sci.as_str(), 0),
    };
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        let s = if exp >= 0 {
            let int_len = exp + 1;
            if n <= int_len {
                format!(
                    "{digits}{}.0",
                    "0".repeat(usize::try_from(int_len - n).unwrap_or(0))
                )
            } else {
                let split = usize::try_from(int_len).unwrap_or(0);
                format!("{}.{}", &digits[..split], &digits[split..])
            }
        } else {
            format!(
                "0.{}{digits}",
                "0".repeat(usize::try_from(-exp - 1).unwrap_or(0))
            )
        };
        format!("{sign}{s}")
    } else {
        let m = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        let e_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{e_sign}{:02}", exp.abs())
    }
}

/// `datetime.now().strftime(format)` for the directives chat templates use (UTC clock).
fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(Value::from(strftime(secs, &format)?))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats Unix time `secs` (UTC) with a subset of C `strftime` directives.
fn strftime(secs: u64, format: &str) -> Result<String, Error> {
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    let (hour, minute, second) = (rem / 3600, (rem % 3600) / 60, rem % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let weekday = usize::try_from((days + 3).rem_euclid(7)).unwrap_or(0); // 1970-01-01 was a Thursday
    let month_name = MONTHS[usize::try_from(month - 1).unwrap_or(0) % 12];
    let weekday_name = WEEKDAYS[weekday];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => write!(out, "{day:02}"),
            Some('m') => write!(out, "{month:02}"),
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('H') => write!(out, "{hour:02}"),
            Some('M') => write!(out, "{minute:02}"),
            Some('S') => write!(out, "{second:02}"),
            Some('B') => write!(out, "{month_name}"),
            Some('b') => write!(out, "{}", &month_name[..3]),
            Some('A') => write!(out, "{weekday_name}"),
            Some('a') => write!(out, "{}", &weekday_name[..3]),
            Some('j') => write!(out, "{:03}", doy_from_jan1(year, month, day)),
            Some('%') => write!(out, "%"),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.unwrap_or(' ')
                    ),
                ))
            }
        }
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, "strftime_now: format error"))?;
    }
    Ok(out)
}

fn doy_from_jan1(year: i64, month: i64, day: i64) -> i64 {
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let idx = usize::try_from(month - 1).unwrap_or(0) % 12;
    CUM[idx] + day + i64::from(leap && month > 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, ctx: serde_json::Value) -> String {
        let t = ChatTemplates::single(src.to_owned()).expect("template compiles");
        let map = ctx.as_object().cloned().unwrap_or_default();
        t.render("default", &map).expect("renders")
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let ctx = serde_json::json!({"x": {"b": 1, "a": [1.0, 2.5, 1e20, 1e-7, "<&'>", "é\n", null, true], "c": {}}});
        assert_eq!(
            render("{{ x | tojson }}", ctx.clone()),
            r#"{"b": 1, "a": [1.0, 2.5, 1e+20, 1e-07, "<&'>", "é\n", null, true], "c": {}}"#
        );
        assert_eq!(
            render("{{ x | tojson(indent=2, sort_keys=true) }}", ctx.clone()),
            "{\n  \"a\": [\n    1.0,\n    2.5,\n    1e+20,\n    1e-07,\n    \"<&'>\",\n    \"é\\n\",\n    null,\n    true\n  ],\n  \"b\": 1,\n  \"c\": {}\n}"
        );
        assert_eq!(
            render("{{ x.a[5] | tojson(ensure_ascii=true) }}", ctx),
            r#""\u00e9\n""#
        );
    }

    #[test]
    fn python_float_repr() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (123456789012345.6, "123456789012345.6"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (-2.0, "-2.0"),
            (1e15, "1000000000000000.0"),
        ] {
            assert_eq!(py_float_repr(f), s, "{f}");
        }
    }

    #[test]
    fn trim_and_lstrip_blocks_and_raise() {
        assert_eq!(
            render(
                "  {% if true %}\nA\n  {% endif %}\nB\n",
                serde_json::json!({})
            ),
            "A\nB"
        );
        let t = ChatTemplates::single("{{ raise_exception('nope') }}".into()).expect("compiles");
        let err = t.render("default", &serde_json::Map::new()).unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC was a Thursday.
        let secs = 1_709_211_909;
        assert_eq!(
            strftime(secs, "%d %b %Y %H:%M:%S %A %j %%").expect("formats"),
            "29 Feb 2024 13:05:09 Thursday 060 %"
        );
    }
}
