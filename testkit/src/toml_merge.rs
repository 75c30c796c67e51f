//! Settings laid over a generated TOML configuration: a key given again replaces the generated
//! one instead of repeating it (a repeated key makes the whole file invalid).

use anyhow::{Context, Result};

/// Lays `over` on `base`: tables merge key by key (recursively); any other value, arrays
/// included, replaces the one in `base`.
pub fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(inner)), toml::Value::Table(over_inner)) => {
                merge(inner, over_inner)
            }
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// `key = value` lines of the `[table]` table, as a document to merge (empty for no lines).
pub fn table_of_lines(table: &str, lines: &[String]) -> Result<toml::Table> {
    if lines.is_empty() {
        return Ok(toml::Table::new());
    }
    let text = format!("[{table}]\n{}\n", lines.join("\n"));
    text.parse()
        .with_context(|| format!("settings for [{table}]: {}", lines.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(s: &str) -> toml::Table {
        s.parse().expect("test TOML")
    }

    #[test]
    fn a_key_given_again_replaces_the_generated_one() {
        let mut base = doc("[scoring]\nitl_objective_s = 0.05\nttft_objective_s = 1.0\n");
        merge(
            &mut base,
            table_of_lines("scoring", &["itl_objective_s = 0.5".into()]).unwrap(),
        );
        let text = toml::to_string(&base).unwrap();
        let back = doc(&text);
        assert_eq!(back["scoring"]["itl_objective_s"].as_float(), Some(0.5));
        assert_eq!(back["scoring"]["ttft_objective_s"].as_float(), Some(1.0));
        assert_eq!(text.matches("itl_objective_s").count(), 1, "{text}");
    }

    #[test]
    fn a_table_lands_at_the_top_level_whatever_the_generated_file_ends_with() {
        let mut base = doc(
            "[inflight]\nrecent_work_window_s = 15.0\n\n[[models]]\nname = \"m\"\n\
             [[models.replicas]]\nname = \"r0\"\n",
        );
        merge(
            &mut base,
            doc("[inflight]\nreport_hold_ms = 0\n[scheduling]\nevent_coalesce_ms = 5\n"),
        );
        let back = doc(&toml::to_string(&base).unwrap());
        assert_eq!(back["inflight"]["report_hold_ms"].as_integer(), Some(0));
        assert_eq!(
            back["inflight"]["recent_work_window_s"].as_float(),
            Some(15.0)
        );
        assert_eq!(
            back["scheduling"]["event_coalesce_ms"].as_integer(),
            Some(5)
        );
        let models = back["models"].as_array().unwrap();
        assert_eq!(models.len(), 1);
        assert!(models[0].get("report_hold_ms").is_none());
        assert_eq!(models[0]["replicas"][0]["name"].as_str(), Some("r0"));
    }

    #[test]
    fn no_lines_add_no_table() {
        let mut base = doc("listen = \"x\"\n");
        merge(&mut base, table_of_lines("index", &[]).unwrap());
        assert!(base.get("index").is_none(), "{base:?}");
    }

    #[test]
    fn settings_that_are_not_toml_are_refused_with_their_text() {
        let err = table_of_lines("scoring", &["itl_objective_s = ".into()]).unwrap_err();
        assert!(format!("{err:#}").contains("itl_objective_s"), "{err:#}");
    }
}
