//! Constructors that build a metric and register it on the default registry, for the
//! `static METRICS: LazyLock<..>` blocks of every component.
//!
//! They panic, naming the metric, on a malformed or duplicate name: names are static, so
//! that is a bug, not a runtime condition.

use prometheus::core::Collector;
use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
};

use crate::LATENCY_BUCKETS_SECONDS;

/// A counter.
pub fn counter(name: &str, help: &str) -> IntCounter {
    register(name, IntCounter::new(name, help))
}

/// A counter with `labels`; `values[i]` lists values of `labels[i]`, and every combination
/// of them is created now, so those series show (as 0) before their first increment.
pub fn counter_vec(name: &str, help: &str, labels: &[&str], values: &[&[&str]]) -> IntCounterVec {
    assert!(values.is_empty() || values.len() == labels.len(), "metric {name}: values for each label, or none");
    let vec = register(name, IntCounterVec::new(Opts::new(name, help), labels));
    let mut combination = Vec::with_capacity(values.len());
    create_all(&vec, values, &mut combination);
    vec
}

fn create_all<'a>(vec: &IntCounterVec, values: &[&[&'a str]], combination: &mut Vec<&'a str>) {
    let Some((first, rest)) = values.split_first() else {
        if !combination.is_empty() {
            vec.with_label_values(combination);
        }
        return;
    };
    for value in *first {
        combination.push(value);
        create_all(vec, rest, combination);
        combination.pop();
    }
}

/// An integer gauge.
pub fn gauge(name: &str, help: &str) -> IntGauge {
    register(name, IntGauge::new(name, help))
}

/// An integer gauge with `labels`.
pub fn gauge_vec(name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    register(name, IntGaugeVec::new(Opts::new(name, help), labels))
}

/// A floating-point gauge (ratios, durations).
pub fn float_gauge(name: &str, help: &str) -> Gauge {
    register(name, Gauge::new(name, help))
}

/// A floating-point gauge with `labels`.
pub fn float_gauge_vec(name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    register(name, GaugeVec::new(Opts::new(name, help), labels))
}

/// A histogram with `buckets`.
pub fn histogram(name: &str, help: &str, buckets: &[f64]) -> Histogram {
    register(name, Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec())))
}

/// A histogram of latencies in seconds ([`LATENCY_BUCKETS_SECONDS`]).
pub fn latency_histogram(name: &str, help: &str) -> Histogram {
    histogram(name, help, LATENCY_BUCKETS_SECONDS)
}

/// A histogram of latencies in seconds ([`LATENCY_BUCKETS_SECONDS`]) with `labels`.
pub fn latency_histogram_vec(name: &str, help: &str, labels: &[&str]) -> HistogramVec {
    let opts = HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS_SECONDS.to_vec());
    register(name, HistogramVec::new(opts, labels))
}

/// The sum over every series of the counter `name` in the default registry (0 before it is
/// registered): for tests and benchmarks that count what a run did.
pub fn counter_total(name: &str) -> u64 {
    prometheus::gather()
        .iter()
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric().iter().map(|m| m.get_counter().get_value() as u64).collect::<Vec<_>>())
        .sum()
}

fn register<C: Collector + Clone + 'static>(name: &str, built: prometheus::Result<C>) -> C {
    let collector = built.unwrap_or_else(|e| panic!("metric {name}: {e}"));
    prometheus::default_registry()
        .register(Box::new(collector.clone()))
        .unwrap_or_else(|e| panic!("metric {name}: {e}"));
    collector
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_combination_of_the_listed_values_is_created() {
        let vec = counter_vec("metric_test_combinations_total", "test", &["a", "b"], &[&["x", "y"], &["1", "2", "3"]]);
        let text = crate::render();
        let series = text.lines().filter(|l| l.starts_with("metric_test_combinations_total{")).count();
        assert_eq!(series, 6, "{text}");
        assert!(text.contains("metric_test_combinations_total{a=\"y\",b=\"3\"} 0"), "{text}");
        vec.with_label_values(&["x", "1"]).inc();
        assert!(crate::render().contains("metric_test_combinations_total{a=\"x\",b=\"1\"} 1"));
    }

    #[test]
    #[should_panic(expected = "metric metric_test_twice_total: ")]
    fn a_second_registration_names_the_metric() {
        counter("metric_test_twice_total", "test");
        counter("metric_test_twice_total", "test");
    }

    #[test]
    #[should_panic(expected = "metric no-dashes: ")]
    fn a_malformed_name_names_the_metric() {
        gauge("no-dashes", "test");
    }
}
