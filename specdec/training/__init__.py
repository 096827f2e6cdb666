"""Training heads against a frozen target (DESIGN.md, "one training pipeline"): a corpus formatted with
the target's chat template (`corpus`), the target's hidden states computed once and cached memory-mapped
(`hidden_cache`), head training from that cache (`medusa`), and the head file format (`heads`)."""
