//! Grouped bar charts as plain SVG (no plotting dependency): the benchmarks' plots.
use std::fmt::Write as _;

/// One group of bars per size, one bar per series (name, colour); `value(size, series)`.
pub fn bars(title: &str, sizes: &[u32], series: &[(&str, &str)], value: impl Fn(u32, &str) -> Option<f64>) -> String {
    let max = sizes.iter().flat_map(|n| series.iter().filter_map(|(m, _)| value(*n, m))).fold(1.0, f64::max);
    let (w, h, left, bottom) = (760.0, 380.0, 70.0, 60.0);
    let group = (w - left - 20.0) / sizes.len().max(1) as f64;
    let bar = group / (series.len() as f64 + 1.0);
    let mut s = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{left}\" y=\"20\" font-size=\"14\">{title}</text>\n");
    let plot_h = h - bottom - 40.0;
    for t in 0..=4 {
        let v = max * t as f64 / 4.0;
        let y = h - bottom - plot_h * t as f64 / 4.0;
        let _ = writeln!(
            s,
            "<line x1=\"{left}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{}\" text-anchor=\"end\">{:.0}</text>",
            w - 20.0,
            left - 5.0,
            y + 4.0,
            v
        );
    }
    for (gi, n) in sizes.iter().enumerate() {
        let gx = left + gi as f64 * group + bar / 2.0;
        for (mi, (m, color)) in series.iter().enumerate() {
            if let Some(v) = value(*n, m) {
                let bh = plot_h * v / max;
                let x = gx + mi as f64 * bar;
                let _ = writeln!(
                    s,
                    "<rect x=\"{x}\" y=\"{}\" width=\"{}\" height=\"{bh}\" fill=\"{color}\"><title>{m} at {n} services: {v:.0}</title></rect>",
                    h - bottom - bh,
                    bar - 4.0
                );
            }
        }
        let _ = writeln!(s, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{n} services</text>", gx + bar * series.len() as f64 / 2.0, h - bottom + 18.0);
    }
    for (mi, (m, color)) in series.iter().enumerate() {
        let x = left + mi as f64 * 170.0;
        let _ = writeln!(
            s,
            "<rect x=\"{x}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"{color}\"/><text x=\"{}\" y=\"{}\">{m}</text>",
            h - 22.0,
            x + 16.0,
            h - 12.0
        );
    }
    s += "</svg>\n";
    s
}
