//! Arbitrary JSON values for property tests: the usual leaves (null, booleans, integers of both
//! signs and small ones, floats, strings from the caller's strategy) nested in arrays and objects
//! whose keys come from the caller's strategy, so that each test can bias both toward its format.

use proptest::prelude::*;
use serde_json::Value;

/// How deep and how big a generated value may grow.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Nesting levels.
    pub depth: u32,
    /// Nodes in all, roughly (proptest's `desired_size`).
    pub size: u32,
    /// Elements of one array or object at most.
    pub width: usize,
}

/// Any JSON value whose strings come from `strings` and object keys from `keys`.
pub fn value<S, K>(strings: S, keys: K, shape: Shape) -> impl Strategy<Value = Value>
where
    S: Strategy<Value = String> + 'static,
    K: Strategy<Value = String> + 'static,
{
    let keys = keys.boxed();
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (0u64..5000).prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f)
            .map(Value::Number)
            .unwrap_or(Value::Null)),
        strings.prop_map(Value::from),
    ];
    let width = shape.width.max(1);
    leaf.prop_recursive(shape.depth, shape.size, width as u32, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..width).prop_map(Value::Array),
            prop::collection::vec((keys.clone(), inner), 0..width)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    #[test]
    fn values_nest_and_use_the_callers_strings() {
        let mut runner = TestRunner::deterministic();
        let strategy = value(
            Just("s".to_string()),
            Just("k".to_string()),
            Shape {
                depth: 3,
                size: 24,
                width: 4,
            },
        );
        let (mut nested, mut strings) = (false, false);
        for _ in 0..500 {
            let v = strategy.new_tree(&mut runner).expect("tree").current();
            let text = v.to_string();
            nested |= v.is_array() || v.is_object();
            strings |= text.contains("\"s\"") || text.contains("\"k\"");
            assert!(!text.contains("\"x\""));
        }
        assert!(nested && strings);
    }
}
