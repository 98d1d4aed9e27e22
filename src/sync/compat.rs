//! kube-runtime compatibility of the stream configuration: a `watcher::Config` converts into
//! a [`StreamConfig`], and a typed label [`Selector`] is accepted as kube-runtime's
//! `labels_from` takes it, so that a port keeps its configuration code.

use kube::core::Selector;
use kube::runtime::watcher;

use super::config::StreamConfig;

impl From<watcher::Config> for StreamConfig {
    /// The stream configuration that lists and watches what `config` would.
    ///
    /// | `watcher::Config` field | here |
    /// |---|---|
    /// | `label_selector`, `field_selector` | [`StreamConfig::labels`], [`StreamConfig::fields`] |
    /// | `timeout` | [`StreamConfig::timeout`] (clamped to 1..=294 s) |
    /// | `page_size` | [`StreamConfig::page_size`]; `None` (unbounded) is the largest page, [`StreamConfig::MAX_PAGE_SIZE`] |
    /// | `initial_list_strategy: StreamingList` | [`StreamConfig::streaming_lists`] |
    /// | `list_semantic` | ignored: every LIST here is a consistent read (`Any`, served from the API server's cache, could be older than the stored checkpoint) |
    /// | `bookmarks` | ignored: bookmarks are always asked for (they move the checkpoint) |
    ///
    /// ```
    /// use kube::runtime::watcher;
    /// use kube_persist::StreamConfig;
    /// let wc = watcher::Config::default().labels("app=web").page_size(100).timeout(60);
    /// let config = StreamConfig::from(wc);
    /// assert_eq!(config.get_label_selector(), Some("app=web"));
    /// assert_eq!((config.get_page_size(), config.get_timeout()), (100, 60));
    /// ```
    fn from(config: watcher::Config) -> Self {
        let mut out = StreamConfig::default();
        if let Some(labels) = &config.label_selector {
            out = out.labels(labels);
        }
        if let Some(fields) = &config.field_selector {
            out = out.fields(fields);
        }
        if let Some(timeout) = config.timeout {
            out = out.timeout(timeout);
        }
        out = out.page_size(config.page_size.unwrap_or(StreamConfig::MAX_PAGE_SIZE));
        if matches!(
            config.initial_list_strategy,
            watcher::InitialListStrategy::StreamingList
        ) {
            out = out.streaming_lists();
        }
        out
    }
}

impl StreamConfig {
    /// Only objects matching this typed label selector, like kube-runtime's
    /// `watcher::Config::labels_from`.
    ///
    /// ```
    /// use kube::core::{Expression, Selector};
    /// let selector: Selector = Expression::Equal("app".into(), "web".into()).into();
    /// let config = kube_persist::StreamConfig::default().labels_from(&selector);
    /// assert_eq!(config.get_label_selector(), Some("app=web"));
    /// ```
    #[must_use = "a setter returns the changed configuration, and changes nothing else"]
    pub fn labels_from(self, selector: &Selector) -> Self {
        self.labels(&selector.to_string())
    }
}
