//! A goal of the benchmark and whether a run met it (the report's "Goals" table).

/// A goal and whether a run met it.
#[derive(Debug, Clone, PartialEq)]
pub struct GoalCheck {
    /// The goal.
    pub goal: String,
    /// Workload, fleet and load it was checked on.
    pub scope: String,
    /// The numbers.
    pub measured: String,
    /// Met, missed, or could not be checked (None).
    pub met: Option<bool>,
}
