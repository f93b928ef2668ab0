"""Task metrics: each checked against a value worked out by hand from the metric's definition."""

from __future__ import annotations

import math

import pytest

from t5forge.train.task_metrics import normalize_answer, score, token_f1


def test_exact_match_compares_stripped_strings():
    assert score(["abspath", " join ", "Join"], ["abspath", "join", "join"], ("exact_match",)) == {
        "exact_match": pytest.approx(200 / 3)}


def test_token_f1_uses_squad_normalisation():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    # prediction {cat, sat, down} vs reference {cat, sat, on, mat}: 2 common, P 2/3, R 2/4 -> F1 4/7
    assert token_f1("the cat sat down", "A cat sat on the mat.") == pytest.approx(4 / 7)
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0 and token_f1("dog", "cat") == 0.0
    assert score(["the cat sat down", "dog"], ["A cat sat on the mat.", "dog"], ("token_f1",))["token_f1"] == \
        pytest.approx(100 * (4 / 7 + 1) / 2)


def test_rouge_l_is_the_longest_common_subsequence_f_measure_with_stemming():
    # LCS of "the cat sat on the mat" and "the cat was on the mat": the cat on the mat (5 of 6 words each side).
    assert score(["the cat sat on the mat"], ["the cat was on the mat"], ("rouge_l",))["rouge_l"] == \
        pytest.approx(100 * 5 / 6)
    # The Porter stemmer makes "cats" and "cat" one word.
    assert score(["the cats sat"], ["the cat sat"], ("rouge_l",))["rouge_l"] == pytest.approx(100.0)


def test_bleu_is_sacrebleus_corpus_bleu_with_exponential_smoothing():
    # n-gram precisions of "the cat sat on the mat" against "the cat is on the mat": 5/6, 3/5, 1/4 and 0/3;
    # sacrebleu's default "exp" smoothing turns the k-th zero count into 1 / (2^k x total): 1/6. Same length:
    # no brevity penalty.
    expected = 100 * math.exp((math.log(5 / 6) + math.log(3 / 5) + math.log(1 / 4) + math.log(1 / 6)) / 4)
    assert score(["the cat sat on the mat"], ["the cat is on the mat"], ("bleu",))["bleu"] == pytest.approx(expected)
    assert score(["a b c d e", "f g h i j"], ["a b c d e", "f g h i j"], ("bleu",))["bleu"] == pytest.approx(100.0)


def test_bad_calls_are_refused():
    with pytest.raises(ValueError, match="as many predictions as references"):
        score(["a"], ["a", "b"])
    with pytest.raises(ValueError, match="unknown metrics"):
        score(["a"], ["a"], ("accuracy",))
