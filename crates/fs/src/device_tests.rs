//! Tests of the device and cache layers.
