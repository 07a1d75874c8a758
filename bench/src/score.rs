//! Scores of `ragkv eval qa`: answer F1 and exact match (SQuAD/HotpotQA normalization),
//! teacher-forced agreement and KL divergence between next-token distributions, and a
//! bootstrap interval for a paired difference of means.

use std::collections::HashMap;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// SQuAD normalization: lower case, no punctuation, no articles, single spaces.
pub fn normalize(s: &str) -> String {
    let lower: String = s
        .to_lowercase()
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    lower
        .split_whitespace()
        .filter(|w| !matches!(*w, "a" | "an" | "the"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Token-level F1 of normalized answers (HotpotQA: yes/no/noanswer must match exactly).
pub fn f1(prediction: &str, gold: &str) -> f64 {
    let (p, g) = (normalize(prediction), normalize(gold));
    let special = ["yes", "no", "noanswer"];
    if (special.contains(&p.as_str()) || special.contains(&g.as_str())) && p != g {
        return 0.0;
    }
    let mut counts: HashMap<&str, i64> = HashMap::new();
    for w in g.split_whitespace() {
        *counts.entry(w).or_default() += 1;
    }
    let mut same = 0;
    for w in p.split_whitespace() {
        if let Some(c) = counts.get_mut(w) {
            if *c > 0 {
                *c -= 1;
                same += 1;
            }
        }
    }
    if same == 0 {
        return 0.0;
    }
    let precision = same as f64 / p.split_whitespace().count() as f64;
    let recall = same as f64 / g.split_whitespace().count() as f64;
    2.0 * precision * recall / (precision + recall)
}

/// Whether the normalized answers are equal (SQuAD normalization).
pub fn exact_match(prediction: &str, gold: &str) -> bool {
    normalize(prediction) == normalize(gold)
}

/// The scored part of a generated answer: its first non-empty line.
pub fn first_line(answer: &str) -> &str {
    answer
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("")
}

/// `x - logsumexp(x)`, in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&x| x as f64 - lse).collect()
}

/// KL(p ‖ q) of two distributions given as log-probabilities, in nats.
pub fn kl(log_p: &[f64], log_q: &[f64]) -> f64 {
    log_p
        .iter()
        .zip(log_q)
        .map(|(&lp, &lq)| {
            if lp == f64::NEG_INFINITY {
                0.0
            } else {
                lp.exp() * (lp - lq)
            }
        })
        .sum::<f64>()
        .max(0.0)
}

/// The index of the largest value (the first of equals).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best
}

/// Teacher-forced fidelity of one answer: how many of the reference's token decisions a
/// strategy makes too, and the summed divergence of its distributions from the reference's.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Forced {
    /// Reference tokens forced.
    pub tokens: usize,
    /// Of those, predicted by the strategy's argmax too.
    pub agree: usize,
    /// Summed KL(reference ‖ strategy), nats.
    pub kl_sum: f64,
}

impl std::ops::AddAssign for Forced {
    fn add_assign(&mut self, o: Forced) {
        self.tokens += o.tokens;
        self.agree += o.agree;
        self.kl_sum += o.kl_sum;
    }
}

/// Compares a strategy's logits rows with the reference's at the same positions: row `i`
/// of both predicts `targets[i]` (the reference's own greedy choice).
pub fn forced(reference: &[Vec<f32>], strategy: &[Vec<f32>], targets: &[u32]) -> Forced {
    let mut out = Forced::default();
    for ((r, s), &t) in reference.iter().zip(strategy).zip(targets) {
        out.tokens += 1;
        out.agree += usize::from(argmax(s) == t as usize);
        out.kl_sum += kl(&log_softmax(r), &log_softmax(s));
    }
    out
}

/// Draws of every bootstrap interval the benchmarks report.
pub const RESAMPLES: usize = 10_000;

/// 95 % bootstrap interval (percentile method, `resamples` draws, fixed seed) of the mean of
/// paired differences `d` (one per question).
pub fn bootstrap_ci95(d: &[f64], resamples: usize) -> (f64, f64) {
    let pairs: Vec<(f64, f64)> = d.iter().map(|&x| (x, 1.0)).collect();
    bootstrap_ratio_ci95(&pairs, resamples)
}

/// 95 % bootstrap interval (as [`bootstrap_ci95`]) of a ratio of sums `Σ a / Σ b` over
/// questions `(a, b)`, resampling whole questions: e.g. agreeing tokens over forced tokens,
/// whose decisions within one answer are not independent.
pub fn bootstrap_ratio_ci95(pairs: &[(f64, f64)], resamples: usize) -> (f64, f64) {
    if pairs.is_empty() {
        return (0.0, 0.0);
    }
    let mut rng = SmallRng::seed_from_u64(0x5eed);
    let n = pairs.len();
    let mut ratios: Vec<f64> = (0..resamples.max(1))
        .map(|_| {
            let (a, b) = (0..n).fold((0.0, 0.0), |(a, b), _| {
                let (x, y) = pairs[rng.gen_range(0..n)];
                (a + x, b + y)
            });
            if b == 0.0 {
                0.0
            } else {
                a / b
            }
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    let at = |q: f64| ratios[((ratios.len() - 1) as f64 * q).round() as usize];
    (at(0.025), at(0.975))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squad_normalization_and_scores() {
        assert_eq!(
            normalize("The  Eiffel-Tower, in Paris!"),
            "eiffeltower in paris"
        );
        assert_eq!(normalize("An apple a day"), "apple day");
        assert!(exact_match("the Beatles.", "Beatles"));
        assert!(!exact_match("Beatles band", "Beatles"));
        assert_eq!(f1("Paris", "Paris"), 1.0);
        assert_eq!(f1("London", "Paris"), 0.0);
        // 1 shared of 2 predicted and 1 gold: P 0.5, R 1, F1 2/3.
        assert!((f1("in Paris", "Paris") - 2.0 / 3.0).abs() < 1e-12);
        // Repeated tokens count once per gold occurrence.
        assert!((f1("paris paris", "paris") - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(f1("yes", "no"), 0.0);
        assert_eq!(f1("no", "no"), 1.0);
        assert_eq!(f1("yes it is", "yes"), 0.0);
        assert_eq!(f1("", "Paris"), 0.0);
    }

    #[test]
    fn the_first_non_empty_line_is_scored() {
        assert_eq!(first_line("\n  Paris \nThe capital."), "Paris");
        assert_eq!(first_line(""), "");
    }

    #[test]
    fn divergence_and_agreement() {
        let p = log_softmax(&[1.0, 2.0, 3.0]);
        let total: f64 = p.iter().map(|x| x.exp()).sum();
        assert!((total - 1.0).abs() < 1e-12);
        // Shifting logits changes nothing.
        let q = log_softmax(&[11.0, 12.0, 13.0]);
        assert!(kl(&p, &q) < 1e-12);
        // KL of two known distributions: p = (1/2, 1/2), q = (1/4, 3/4).
        let (a, b) = ([0.5f64.ln(), 0.5f64.ln()], [0.25f64.ln(), 0.75f64.ln()]);
        let want = 0.5 * (0.5f64 / 0.25).ln() + 0.5 * (0.5f64 / 0.75).ln();
        assert!((kl(&a, &b) - want).abs() < 1e-12);
        assert!(kl(&a, &b) > 0.0 && kl(&b, &a) > 0.0);
        assert_eq!(argmax(&[0.0, 3.0, 3.0, 1.0]), 1);

        let reference = vec![vec![0.0, 5.0, 0.0], vec![4.0, 0.0, 0.0]];
        let same = forced(&reference, &reference, &[1, 0]);
        assert_eq!((same.tokens, same.agree), (2, 2));
        assert!(same.kl_sum < 1e-12);
        let other = vec![vec![0.0, 5.0, 0.0], vec![0.0, 0.0, 4.0]];
        let f = forced(&reference, &other, &[1, 0]);
        assert_eq!((f.tokens, f.agree), (2, 1));
        assert!(f.kl_sum > 1.0);
    }

    #[test]
    fn bootstrap_brackets_the_mean() {
        let d: Vec<f64> = (0..100).map(|i| f64::from(i % 10) / 10.0 - 0.45).collect();
        let (lo, hi) = bootstrap_ci95(&d, 2000);
        let mean = d.iter().sum::<f64>() / d.len() as f64;
        assert!(lo < mean && mean < hi, "{lo} {mean} {hi}");
        assert!(hi - lo < 0.2, "{lo} {hi}");
        // No spread, no interval; deterministic.
        assert_eq!(bootstrap_ci95(&[0.25; 7], 500), (0.25, 0.25));
        assert_eq!(bootstrap_ci95(&d, 2000), (lo, hi));
        assert_eq!(bootstrap_ci95(&[], 10), (0.0, 0.0));
    }

    #[test]
    fn ratio_bootstrap_weighs_questions_by_their_tokens() {
        // Agreeing tokens over forced tokens, answers of different lengths: 93 % pooled.
        let pairs: Vec<(f64, f64)> = (0..60)
            .map(|i| {
                if i % 3 == 0 {
                    (8.0, 10.0)
                } else {
                    (10.0, 10.0)
                }
            })
            .chain([(0.0, 2.0)])
            .collect();
        let (a, b) = pairs.iter().fold((0.0, 0.0), |s, p| (s.0 + p.0, s.1 + p.1));
        let ratio = a / b;
        let (lo, hi) = bootstrap_ratio_ci95(&pairs, 2000);
        assert!(lo < ratio && ratio < hi, "{lo} {ratio} {hi}");
        assert!(lo > 0.88 && hi < 0.97, "{lo} {hi}");
        // The pooled ratio (0.930), not the mean of per-question ratios (0.918).
        let mean_of_ratios = pairs.iter().map(|p| p.0 / p.1).sum::<f64>() / pairs.len() as f64;
        assert!((mean_of_ratios - ratio).abs() > 0.01);
        assert_eq!(bootstrap_ratio_ci95(&[(3.0, 4.0); 5], 100), (0.75, 0.75));
        assert_eq!(bootstrap_ratio_ci95(&[(0.0, 0.0)], 10), (0.0, 0.0));
    }
}
