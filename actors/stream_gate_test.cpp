// StreamGate against the straightforward rule: the client's stream is the single attempt's stream, each
// chunk once, whatever the interleaving of two attempts' chunks, and whatever chunk a new attempt resumes at.
#include "actors/stream_gate.hpp"

#include <gtest/gtest.h>

namespace deltaserve::actors {
namespace {

using Verdict = StreamGate::Verdict;

router::GenerationChunk token(int32_t t) {
  router::GenerationChunk c;
  c.request_id = "r";
  c.tokens = {t};
  return c;
}

router::GenerationChunk failure() {
  router::GenerationChunk c;
  c.request_id = "r";
  c.error = Status(StatusCode::kUnavailable, "moved");
  return c;
}

TEST(StreamGate, OneAttemptPassesEverything) {
  StreamGate gate;
  for (int32_t t : {5, 6, 7}) EXPECT_EQ(gate.admit(1, token(t)), Verdict::kForward);
  EXPECT_EQ(gate.owner(), 1);
  EXPECT_EQ(gate.forwarded(), 3u);
  EXPECT_EQ(gate.admit(0, failure()), Verdict::kForward);  // the router's own chunk always passes
}

TEST(StreamGate, AnnouncedAttemptBeforeAnyChunkMakesTheOldOneStale) {
  StreamGate gate;
  gate.announce(2, 0);
  EXPECT_EQ(gate.admit(1, token(5)), Verdict::kDrop);
  EXPECT_EQ(gate.admit(2, token(5)), Verdict::kForward);
  EXPECT_EQ(gate.admit(1, token(6)), Verdict::kDrop);
  EXPECT_EQ(gate.owner(), 2);
  EXPECT_EQ(gate.dropped(), 2);
}

TEST(StreamGate, NewAttemptReplaysThenTakesOverWithoutRepeating) {
  StreamGate gate;
  EXPECT_EQ(gate.admit(1, token(5)), Verdict::kForward);
  EXPECT_EQ(gate.admit(1, token(6)), Verdict::kForward);
  gate.announce(2, 0);
  EXPECT_EQ(gate.admit(1, failure()), Verdict::kDrop);  // the owner gave the request up to attempt 2
  EXPECT_EQ(gate.admit(2, token(5)), Verdict::kDrop);   // replayed, matches
  EXPECT_EQ(gate.admit(2, token(6)), Verdict::kDrop);
  EXPECT_EQ(gate.admit(2, token(7)), Verdict::kForward);  // new to the client
  EXPECT_EQ(gate.owner(), 2);
  EXPECT_EQ(gate.forwarded(), 3u);
}

TEST(StreamGate, OwnerThatKeepsGoingStaysTheOwnerUntilOvertaken) {
  StreamGate gate;
  EXPECT_EQ(gate.admit(1, token(5)), Verdict::kForward);
  gate.announce(2, 0);
  EXPECT_EQ(gate.admit(2, token(5)), Verdict::kDrop);     // replaying
  EXPECT_EQ(gate.admit(1, token(6)), Verdict::kForward);  // the stalled attempt came back first
  EXPECT_EQ(gate.admit(2, token(6)), Verdict::kDrop);
  EXPECT_EQ(gate.admit(2, token(7)), Verdict::kForward);  // attempt 2 overtook: it owns the stream now
  EXPECT_EQ(gate.admit(1, token(7)), Verdict::kDrop);
  EXPECT_EQ(gate.owner(), 2);
}

TEST(StreamGate, ReplayThatDiffersEndsTheStream) {
  StreamGate gate;
  EXPECT_EQ(gate.admit(1, token(5)), Verdict::kForward);
  gate.announce(2, 0);
  EXPECT_EQ(gate.admit(2, token(9)), Verdict::kDiverged);
}

TEST(StreamGate, OwnerFailureWithoutANewerAttemptEndsTheStream) {
  StreamGate gate;
  EXPECT_EQ(gate.admit(1, token(5)), Verdict::kForward);
  EXPECT_EQ(gate.admit(1, failure()), Verdict::kForward);
}

TEST(StreamGate, NewAttemptFailingWhileNobodyOwnsTheStreamEndsIt) {
  StreamGate gate;
  EXPECT_EQ(gate.admit(1, token(5)), Verdict::kForward);
  gate.announce(2, 0);
  EXPECT_EQ(gate.admit(1, failure()), Verdict::kDrop);     // attempt 1 gave up
  EXPECT_EQ(gate.admit(2, failure()), Verdict::kForward);  // and attempt 2 failed: the client must hear it
}

TEST(StreamGate, AttemptResumedWhereTheClientIsTakesOverAtOnce) {
  StreamGate gate;
  for (int32_t t : {5, 6}) EXPECT_EQ(gate.admit(1, token(t)), Verdict::kForward);
  gate.announce(2, 2);                                    // prefilled with the prompt and tokens 5, 6
  EXPECT_EQ(gate.admit(2, token(7)), Verdict::kForward);  // chunk 2 of the stream
  EXPECT_EQ(gate.admit(1, token(7)), Verdict::kDrop);     // the stalled attempt is stale now
  EXPECT_EQ(gate.admit(2, token(8)), Verdict::kForward);
  EXPECT_EQ(gate.owner(), 2);
  EXPECT_EQ(gate.forwarded(), 4u);
}

TEST(StreamGate, ResumedAttemptReplaysOnlyWhatTheClientGotAfterItsStart) {
  StreamGate gate;
  for (int32_t t : {5, 6, 7}) EXPECT_EQ(gate.admit(1, token(t)), Verdict::kForward);
  gate.announce(2, 1);                                    // the router had heard of one chunk; the client has three
  EXPECT_EQ(gate.admit(1, token(8)), Verdict::kForward);  // the old owner is still going
  EXPECT_EQ(gate.admit(2, token(6)), Verdict::kDrop);     // chunk 1, replayed
  EXPECT_EQ(gate.admit(2, token(7)), Verdict::kDrop);
  EXPECT_EQ(gate.admit(2, token(8)), Verdict::kDrop);
  EXPECT_EQ(gate.admit(2, token(9)), Verdict::kForward);  // caught up: attempt 2 owns the stream
  EXPECT_EQ(gate.admit(1, token(9)), Verdict::kDrop);
  EXPECT_EQ(gate.owner(), 2);
  EXPECT_EQ(gate.forwarded(), 5u);
}

TEST(StreamGate, ResumedAttemptAfterTheOwnerGaveUp) {
  StreamGate gate;
  for (int32_t t : {5, 6}) EXPECT_EQ(gate.admit(1, token(t)), Verdict::kForward);
  gate.announce(2, 2);
  EXPECT_EQ(gate.admit(1, failure()), Verdict::kDrop);
  EXPECT_EQ(gate.owner(), 0);
  EXPECT_EQ(gate.admit(2, token(7)), Verdict::kForward);
  EXPECT_EQ(gate.owner(), 2);
}

TEST(StreamGate, ReplayedChunkThatEndsWhereTheClientWentOnDiverges) {
  StreamGate gate;
  for (int32_t t : {5, 6}) EXPECT_EQ(gate.admit(1, token(t)), Verdict::kForward);
  gate.announce(2, 1);
  router::GenerationChunk last = token(6);
  last.finish_reason = "length";
  EXPECT_EQ(gate.admit(2, last), Verdict::kDiverged);
}

TEST(StreamGate, AbortWhileReplayingEndsTheStream) {
  StreamGate gate;
  for (int32_t t : {5, 6}) EXPECT_EQ(gate.admit(1, token(t)), Verdict::kForward);
  gate.announce(2, 0);
  router::GenerationChunk abort;
  abort.request_id = "r";
  abort.finish_reason = "abort";
  EXPECT_EQ(gate.admit(2, abort), Verdict::kForward);
}

}  // namespace
}  // namespace deltaserve::actors
