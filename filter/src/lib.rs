//! kvroute Envoy filter.
