"""engine/model/train.py's context-training sequences (Tasks): the kinds a --task-mix names,
where their repeats and answers lie, and the loss weights --filler-weight gives them.

Run by ctest (train_tasks_test) with the system python3; skipped where torch or numpy is not
importable (train.py needs both). The tokenizer and text are the shipped model's and its
held-out eval text, so no dataset is needed."""

import importlib.util
import os
import random
import sys
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL_DIR = os.path.join(ROOT, "engine", "model")
sys.path.insert(0, MODEL_DIR)


def load_train():
    try:
        spec = importlib.util.spec_from_file_location("kvtier_train", os.path.join(MODEL_DIR, "train.py"))
        train = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(train)
        return train, ""
    except ImportError as e:
        return None, "%s: %s" % (type(e).__name__, e)


train, WHY = load_train()


@unittest.skipIf(train is None, "train.py not importable: %s" % WHY)
class TasksTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import numpy as np
        import gguf_write

        kv, _ = gguf_write.read(os.path.join(MODEL_DIR, "kvtier-tiny.gguf"))
        cls.bpe = train.Bpe(kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.merges"])
        with open(os.path.join(MODEL_DIR, "golden", "eval.txt"), encoding="utf-8") as f:
            ids = cls.bpe.encode(f.read())
        cls.stream = np.array(ids * 2, dtype=np.int32)

    def tasks(self, mix, filler_weight=1.0, seed=1):
        return train.Tasks(self.stream, self.bpe, len(self.bpe.tokens) - 2, 4096,
                           random.Random(seed), train.Tasks.parse_mix(mix), filler_weight)

    def test_parse_mix_normalises_and_refuses_unknown_kinds(self):
        mix = train.Tasks.parse_mix("text=1,shuffled=3")
        self.assertEqual(mix, (("text", 0.25), ("shuffled", 0.75)))
        for bad in ("text=1,nope=1", "text=x", "text=0", "text=-1,copy=2"):
            with self.assertRaises(SystemExit):
                train.Tasks.parse_mix(bad)

    def test_shuffled_passages_repeat_at_their_distance_and_only_the_repeat_weighs_one(self):
        t = self.tasks("shuffled=1", filler_weight=0.05)
        distances = []
        for _ in range(40):
            ids, pos, w = t.sample(2048, False)
            self.assertEqual((len(ids), len(pos), len(w)), (2049, 2048, 2048))
            self.assertEqual(pos, list(range(2048)))
            ones = [i for i, x in enumerate(w) if x == 1.0]
            self.assertTrue(ones)
            self.assertTrue(all(x in (1.0, 0.05) for x in w))
            self.assertEqual(ones, list(range(ones[0], ones[-1] + 1)))  # one run
            # targets ones[0]..ones[-1] predict ids[ones[0] + 1 ..]: the repeat after its
            # first token; the same tokens stand d earlier
            start, end = ones[0], ones[-1] + 2   # the repeat is ids[start:end]
            length = end - start
            found = [d for d in range(length, start + 1)
                     if ids[start - d:end - d] == ids[start:end]]
            self.assertTrue(found, "no earlier occurrence of the repeat")
            distances.append(found[0])
        self.assertGreater(max(distances), 1000)   # uniform distances reach far back

    def test_a_shuffled_passage_is_the_corpus_s_words_in_another_order(self):
        t = self.tasks("shuffled=1", seed=3)
        text = t.text(400)
        t.rng = random.Random(7)
        t.text = lambda n, _text=text: list(_text[:n])     # the passage's source, fixed
        out = t.shuffled(300)
        self.assertEqual(len(out), 300)
        self.assertEqual(sorted(out), sorted(text[:300]))   # the same tokens ...
        self.assertNotEqual(out, text[:300])                 # ... in another order

    def test_pass_keys_weigh_one_on_the_question_and_answer_only(self):
        t = self.tasks("passkey=1", filler_weight=0.1, seed=5)
        for _ in range(20):
            ids, _, w = t.sample(1024, False)
            ones = [i for i, x in enumerate(w) if x == 1.0]
            self.assertEqual(ones[-1], 1023)                 # through the last target
            answer = self.bpe.decode(ids[ones[0] + 1:])
            self.assertIn("pass key", answer)
            self.assertTrue(any(c.isdigit() for c in answer))
            self.assertGreater(len(ones), 4)
            self.assertLess(len(ones), 80)

    def test_needle_near_puts_the_last_needle_right_before_the_question(self):
        def gaps(near, seed):
            t = train.Tasks(self.stream, self.bpe, len(self.bpe.tokens) - 2, 4096,
                            random.Random(seed), train.Tasks.parse_mix("passkey=1"), 0.1, near)
            out = []
            for _ in range(60):
                ids, _, w = t.sample(1024, False)
                q = [i for i, x in enumerate(w) if x == 1.0][0]  # the question's first token
                last = max(i for i in range(q) if train.digit_token(self.bpe, ids[i]))
                out.append(q - last)  # the last needle's key to the question
            return out
        near, uniform = gaps(1.0, 11), gaps(0.0, 11)
        # every needle near: its key ends within 32 tokens of filler and the needle's closing
        # words of the question; uniform placement leaves hundreds on average
        self.assertLess(max(near), 32 + 8)
        self.assertGreater(sum(uniform) / len(uniform), 150)

    def test_repeat_digits_gives_keys_a_run_of_equal_digits(self):
        import re
        run = re.compile(r"(\d)\1\1")
        def keys(repeat, seed):
            rng = random.Random(seed)
            return [train.random_key(rng, repeat) for _ in range(400)]
        plain, runs = keys(0.0, 5), keys(1.0, 5)
        # repeat = 0 draws exactly the keys it always drew (the card's measurements use them)
        rng, before = random.Random(5), []
        for _ in range(400):
            d = rng.randint(5, 7)
            before.append(str(rng.randint(10 ** (d - 1), 10 ** d - 1)))
        self.assertEqual(plain, before)
        for k in runs:
            self.assertRegex(k, r"^[1-9]\d{4,6}$")
            self.assertRegex(k, run)
        self.assertLess(sum(bool(run.search(k)) for k in plain), 40)
        # and the training sequences carry them: every key of a pass-key-only mix has a run
        t = train.Tasks(self.stream, self.bpe, len(self.bpe.tokens) - 2, 4096, random.Random(3),
                        train.Tasks.parse_mix("passkey=1"), 0.1, 0.0, 1.0)
        for _ in range(20):
            ids, _, w = t.sample(512, False)
            answer = self.bpe.decode([x for x, wt in zip(ids, w) if wt == 1.0])
            for k in re.findall(r"\d{5,7}", answer):
                self.assertRegex(k, run)

    def test_without_a_filler_weight_every_target_weighs_one(self):
        t = self.tasks("text=1,copy=1,passkey=1,shuffled=1", seed=9)
        for _ in range(10):
            _, _, w = t.sample(512, False)
            self.assertEqual(set(w), {1.0})

    def test_a_copy_trial_s_repeat_ends_the_context(self):
        src = list(range(10, 2010))
        filler = list(range(3000, 9000))
        for context in (0, 4096):
            ids, first_at, repeat_at = train.copy_ids(1, src, filler, 2048, 256,
                                                      random.Random(3), context)
            self.assertEqual(len(ids), context or 1 + 2048 + 256)
            self.assertEqual(repeat_at - first_at, 2048)
            self.assertEqual(repeat_at + 256, len(ids))
            self.assertEqual(ids[first_at:first_at + 256], ids[repeat_at:])
            self.assertTrue(set(ids[first_at:first_at + 256]) <= set(src))
            self.assertTrue(set(ids[1:first_at] + ids[first_at + 256:repeat_at]) <= set(filler))
        # Without a context the trial is the one the card always drew (same draws, same tokens).
        rng = random.Random(5)
        s = rng.randrange(len(src) - 256)
        f = rng.randrange(len(filler) - (2048 - 256))
        want = [1] + src[s:s + 256] + filler[f:f + 2048 - 256] + src[s:s + 256]
        self.assertEqual(train.copy_ids(1, src, filler, 2048, 256, random.Random(5))[0], want)

    def test_copy_losses_score_the_passage_and_its_repeat_after_the_skip(self):
        import torch
        vocab, skip = 12000, 16
        # A model that predicts every token of the repeat after its first `skip` and nothing
        # else: the repeat's loss is ~0 and the first occurrence's is log(vocab) exactly.
        ids, _, repeat_at = train.copy_ids(1, list(range(10, 2010)), list(range(3000, 9000)),
                                           512, 128, random.Random(4), 1024)

        def model(x):
            logits = torch.zeros(1, x.shape[1], vocab)
            for i in range(repeat_at + skip - 1, x.shape[1]):
                logits[0, i, ids[i + 1]] = 40.0
            return logits
        first, second = train.copy_losses(model, 1, list(range(10, 2010)),
                                          list(range(3000, 9000)), 512, 128, random.Random(4),
                                          skip=skip, context=1024)
        self.assertAlmostEqual(first, torch.log(torch.tensor(float(vocab))).item(), places=4)
        self.assertLess(second, 1e-6)

    def test_the_weighted_loss_is_the_plain_mean_when_every_weight_is_one(self):
        import torch
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(2, 5, 11, generator=g)
        y = torch.randint(0, 11, (2, 5), generator=g)
        plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        ones = torch.ones(2, 5)
        torch.testing.assert_close(train.weighted_loss(logits, y, ones), plain)
        w = torch.zeros(2, 5)
        w[1, 3] = 1.0
        ce = torch.nn.functional.cross_entropy(logits[1, 3][None], y[1, 3][None])
        torch.testing.assert_close(train.weighted_loss(logits, y, w), ce)


if __name__ == "__main__":
    unittest.main()
