//! Scoring.
