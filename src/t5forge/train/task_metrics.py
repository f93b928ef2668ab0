"""Scores of generated text against reference text, each on a 0-100 scale (higher is better):

- exact_match: the share of predictions equal to their reference after stripping surrounding whitespace
  (T5's `sequence_accuracy`);
- token_f1: the mean over examples of the F1 of the word bags of prediction and reference, both normalised
  as the SQuAD evaluation script does (lower case, no punctuation, no articles, single spaces);
- rouge_l: the mean ROUGE-L F-measure (longest common subsequence), Google's `rouge-score` with its
  tokenizer and Porter stemmer;
- bleu: corpus BLEU from `sacrebleu` (13a tokenisation, 4-grams, brevity penalty).

ROUGE and BLEU come from the maintained packages, never re-implemented; exact match and token F1 are a few
lines, written out so that their normalisation is visible.

Several tasks (data.tasks) are scored one by one and averaged (`score_tasks`)."""

from __future__ import annotations

import re
import string
from collections import Counter

from t5forge.config import TASK_METRICS


def normalize_answer(text: str) -> str:
    """SQuAD v1.1's normalisation: lower case, punctuation and the articles a/an/the removed, spaces collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, reference: str) -> float:
    """F1 (0..1) of the normalised word bags; two empty texts agree fully."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def score(predictions: list[str], references: list[str], metrics: tuple[str, ...] = TASK_METRICS) -> dict[str, float]:
    """{metric: score on 0-100} over aligned lists of predictions and references."""
    if len(predictions) != len(references) or not predictions:
        raise ValueError(f"need as many predictions as references, at least one: got {len(predictions)} and "
                         f"{len(references)}")
    unknown = set(metrics) - set(TASK_METRICS)
    if unknown:
        raise ValueError(f"unknown metrics {sorted(unknown)}; known: {', '.join(TASK_METRICS)}")
    n = len(predictions)
    result = {}
    if "exact_match" in metrics:
        result["exact_match"] = 100 * sum(p.strip() == r.strip() for p, r in zip(predictions, references)) / n
    if "token_f1" in metrics:
        result["token_f1"] = 100 * sum(token_f1(p, r) for p, r in zip(predictions, references)) / n
    if "rouge_l" in metrics:
        from rouge_score import rouge_scorer

        scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
        # rouge-score's argument order is (target, prediction).
        result["rouge_l"] = 100 * sum(scorer.score(r, p)["rougeL"].fmeasure
                                      for p, r in zip(predictions, references)) / n
    if "bleu" in metrics:
        import sacrebleu

        result["bleu"] = sacrebleu.corpus_bleu(predictions, [references]).score
    return result


def score_tasks(predictions: dict[str, list[str]], references: dict[str, list[str]],
                metric_of: dict[str, str]) -> dict[str, float]:
    """Scores of several tasks ({task: aligned predictions / references}): "TASK/METRIC" for every task and metric,
    "METRIC" its mean over the tasks, and "mean" the mean over the tasks of each one's own metric (`metric_of`),
    as GLUE's average score (every task counts the same, whatever its number of examples)."""
    scores, per_task = {}, {}
    for task in metric_of:
        per_task[task] = score(predictions[task], references[task])
        scores.update({f"{task}/{metric}": value for metric, value in per_task[task].items()})
    for metric in TASK_METRICS:
        scores[metric] = sum(s[metric] for s in per_task.values()) / len(per_task)
    scores["mean"] = sum(per_task[task][metric] for task, metric in metric_of.items()) / len(per_task)
    return scores
