//! `[peers]`: where the gateways' indexers share their decisions (a Redis or Valkey server), how
//! they authenticate, and the bounds.

use serde::{Deserialize, Serialize};

/// `[peers]` of the indexer configuration. Absent: nothing is shared (the default).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PeersSection {
    /// The Redis/Valkey server, `host:port` (e.g. `"redis.kvroute.svc:6379"`).
    pub redis: String,
    /// ACL user name (Redis 6+); without it `AUTH` uses the password alone (`requirepass`).
    #[serde(default)]
    pub username: Option<String>,
    /// Password (prefer `password_env`: a file is read by more people than an environment).
    #[serde(default)]
    pub password: Option<String>,
    /// Name of an environment variable holding the password (wins over `password`).
    #[serde(default)]
    pub password_env: Option<String>,
    /// Pub/sub channel. Every gateway of one fleet uses the same; fleets sharing a server use
    /// different ones (pub/sub channels ignore the database number). Default `kvroute:decisions`.
    #[serde(default = "default_channel")]
    pub channel: String,
    /// Most peers' decisions counted at once (the oldest go first). Default 50000.
    #[serde(default = "default_max_remote_pending")]
    pub max_remote_pending: usize,
    /// Decisions waiting to be published; when full, new ones are dropped (counted), never
    /// waited for. Default 4096.
    #[serde(default = "default_queue")]
    pub queue: usize,
    /// First wait before reconnecting to a server that is down, ms (doubles up to `retry_max_ms`).
    /// Default 200.
    #[serde(default = "default_retry_initial_ms")]
    pub retry_initial_ms: u64,
    /// Longest wait between reconnects, ms. Default 5000.
    #[serde(default = "default_retry_max_ms")]
    pub retry_max_ms: u64,
    /// Connect and command timeout, ms. Default 1000.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
}

fn default_channel() -> String {
    "kvroute:decisions".into()
}
fn default_max_remote_pending() -> usize {
    50_000
}
fn default_queue() -> usize {
    4096
}
fn default_retry_initial_ms() -> u64 {
    200
}
fn default_retry_max_ms() -> u64 {
    5000
}
fn default_timeout_ms() -> u64 {
    1000
}

impl PeersSection {
    /// Checks the fields; the error is (field, message).
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        let port = self
            .redis
            .rsplit_once(':')
            .and_then(|(host, port)| (!host.is_empty()).then_some(port))
            .and_then(|p| p.parse::<u16>().ok());
        if port.is_none_or(|p| p == 0) || self.redis.contains('/') || self.redis.contains('@') {
            return Err((
                "redis",
                format!(
                    "{:?} is not host:port (credentials go in password or password_env)",
                    self.redis
                ),
            ));
        }
        if self.channel.is_empty() {
            return Err(("channel", "must not be empty".into()));
        }
        if self.username.as_deref() == Some("") {
            return Err(("username", "must not be empty".into()));
        }
        if self.password.as_deref() == Some("") {
            return Err(("password", "must not be empty".into()));
        }
        if let Some(var) = &self.password_env {
            if std::env::var(var).map(|v| v.is_empty()).unwrap_or(true) {
                return Err((
                    "password_env",
                    format!("environment variable {var} is not set or empty"),
                ));
            }
        }
        if self.max_remote_pending == 0 {
            return Err(("max_remote_pending", "must be > 0".into()));
        }
        if self.queue == 0 {
            return Err(("queue", "must be > 0".into()));
        }
        if self.retry_initial_ms == 0 {
            return Err(("retry_initial_ms", "must be > 0".into()));
        }
        if self.retry_max_ms < self.retry_initial_ms {
            return Err(("retry_max_ms", "must be >= retry_initial_ms".into()));
        }
        if self.timeout_ms == 0 {
            return Err(("timeout_ms", "must be > 0".into()));
        }
        Ok(())
    }

    /// The password, from `password_env` or `password`.
    pub fn password(&self) -> Option<String> {
        self.password_env
            .as_deref()
            .and_then(|var| std::env::var(var).ok())
            .filter(|v| !v.is_empty())
            .or_else(|| self.password.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(text: &str) -> PeersSection {
        toml::from_str(text).expect("parses")
    }

    #[test]
    fn defaults_and_bad_fields_are_named() {
        let s = section("redis = \"127.0.0.1:6379\"");
        assert!(s.validate().is_ok());
        assert_eq!(s.channel, "kvroute:decisions");
        for (text, field) in [
            ("redis = \"127.0.0.1\"", "redis"),
            ("redis = \"redis://:pw@h:1\"", "redis"),
            ("redis = \":6379\"", "redis"),
            ("redis = \"h:1\"\nqueue = 0", "queue"),
            (
                "redis = \"h:1\"\nmax_remote_pending = 0",
                "max_remote_pending",
            ),
            ("redis = \"h:1\"\nretry_max_ms = 1", "retry_max_ms"),
            (
                "redis = \"h:1\"\npassword_env = \"KVROUTE_TEST_UNSET_VAR\"",
                "password_env",
            ),
            ("redis = \"h:1\"\npassword = \"\"", "password"),
        ] {
            assert_eq!(
                section(text).validate().map_err(|e| e.0),
                Err(field),
                "{text}"
            );
        }
        assert!(toml::from_str::<PeersSection>("redis = \"h:1\"\nnope = 1").is_err());
    }
}
